"""A near-zero-cost fake vLLM for the benchmark: raw asyncio protocol on uvloop, one process.

Serves what the proxy needs and nothing more, with no framework in the way:
* ``POST /v1/completions``: a fixed completion JSON (Content-Length; after ``service_ms``), or, when the body has
  ``"stream": true``, an SSE stream (chunked, one HTTP chunk per event) of ``max_tokens`` events.
  Every SSE event carries ``"t":<CLOCK_MONOTONIC ns at write>`` so a client on the same machine can
  measure per-event latency. Events are paced by one global ticker at ``rate`` events/s, shared
  round-robin by every open stream (``rate`` 0: as fast as the sockets take them).
* ``/health``, ``/is_sleeping``, ``/is_paused``, ``/v1/models``, ``POST /sleep``, ``POST /wake_up``
  (each op takes ``op_ms``, then flips the flags the way vLLM does: asleep means paused too); ``POST /pause``,
  ``/resume`` (at once; paused reads as sleeping too, as in vLLM), ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update`` (200 at once: a weight sync with no weights).
* ``/bench/config?rate=R&op_ms=M&service_ms=S``, ``/bench/reset``, ``/bench/stats``: the harness's own controls;
  stats give the arrival count and first/last arrival times of non-streaming completions, the
  time the last ``/wake_up`` finished and when the proxy's verification read the flags after it, all
  CLOCK_MONOTONIC ns (comparable across processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import parse_qsl

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2},
    },
    separators=(",", ":"),
).encode()
MODELS = b'{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"bench","max_model_len":512}]}'
EVENT_HEAD = b'data: {"id":"cmpl-bench","object":"text_completion","created":1700000000,"model":"tiny",'
EVENT_HEAD += b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}],"t":'
DONE = b"data: [DONE]\n\n"
DONE_CHUNK = b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE)
SSE_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
SSE_HEADERS += b"transfer-encoding: chunked\r\n\r\n"
HIGH_WATER = 256 * 1024
WEIGHT_SYNC = (b"/start_weight_update", b"/update_weights", b"/finish_weight_update")


class State:
    def __init__(self) -> None:
        self.sleeping = False
        self.paused = False
        self.rate = 0.0
        self.op_s = 0.0
        self.service_s = 0.0
        self.count = 0
        self.first_ns = 0
        self.last_ns = 0
        self.wake_done_ns = 0
        self.flag_ns = 0
        self.flags_after_wake = 0
        self.streams: list[Stream] = []
        self.kick = asyncio.Event()

    def flag_read(self) -> None:
        """The proxy's verification reads both flags once after a wake; later reads are its reconcile loop."""
        if self.wake_done_ns and self.flags_after_wake < 2:
            self.flags_after_wake += 1
            self.flag_ns = time.monotonic_ns()

    def reset(self) -> None:
        self.count = self.first_ns = self.last_ns = self.wake_done_ns = self.flag_ns = 0


class Stream:
    __slots__ = ("transport", "left")

    def __init__(self, transport: asyncio.Transport, left: int) -> None:
        self.transport = transport
        self.left = left


def response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        ctype,
        len(body),
        body,
    )


OK_COMPLETION = response("200 OK", COMPLETION)
OK_EMPTY = response("200 OK", b"")
NOT_FOUND = response("404 Not Found", b'{"detail":"Not Found"}')


class Conn(asyncio.Protocol):
    def __init__(self, state: State) -> None:
        self.state = state
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a stream or a delayed op is answering on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.streams = [s for s in self.state.streams if s.transport is not self.transport]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : stop if stop >= 0 else len(lower)])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
            method, target, _ = line.split(b" ", 2)
            self.handle(method, target, body)

    def handle(self, method: bytes, target: bytes, body: bytes) -> None:
        st = self.state
        t = self.transport
        assert t is not None
        path, _, query = target.partition(b"?")
        if path == b"/v1/completions":
            if b'"stream":true' in body.replace(b" ", b""):
                tokens = int(json.loads(body).get("max_tokens", 16))
                t.write(SSE_HEADERS)
                self.busy = True
                st.streams.append(Stream(t, tokens))
                st.kick.set()
                return
            now = time.monotonic_ns()
            if not st.count:
                st.first_ns = now
            st.count += 1
            st.last_ns = now
            if st.service_s:  # a generation that takes time: what a swap's drain waits for
                self.busy = True
                asyncio.get_running_loop().call_later(st.service_s, self.completion_done)
                return
            t.write(OK_COMPLETION)
        elif path == b"/health":
            t.write(OK_EMPTY)
        elif path == b"/is_sleeping":
            st.flag_read()
            t.write(response("200 OK", b'{"is_sleeping":%s}' % (b"true" if st.sleeping or st.paused else b"false")))
        elif path == b"/is_paused":
            st.flag_read()
            t.write(response("200 OK", b'{"is_paused":%s}' % (b"true" if st.sleeping or st.paused else b"false")))
        elif path == b"/v1/models":
            t.write(response("200 OK", MODELS))
        elif path in (b"/sleep", b"/wake_up") and method == b"POST":
            self.busy = True
            asyncio.get_running_loop().call_later(st.op_s, self.op_done, path == b"/sleep")
        elif path in (b"/pause", b"/resume") and method == b"POST":
            st.paused = path == b"/pause"
            t.write(OK_EMPTY)
        elif path in WEIGHT_SYNC and method == b"POST":
            t.write(OK_EMPTY)
        elif path == b"/bench/config":
            for key, value in parse_qsl(query.decode()):
                if key == "rate":
                    st.rate = float(value)
                elif key == "op_ms":
                    st.op_s = float(value) / 1000
                elif key == "service_ms":
                    st.service_s = float(value) / 1000
            t.write(OK_EMPTY)
        elif path == b"/bench/reset":
            st.reset()
            t.write(OK_EMPTY)
        elif path == b"/bench/stats":
            stats = {
                "count": st.count,
                "first_ns": st.first_ns,
                "last_ns": st.last_ns,
                "wake_done_ns": st.wake_done_ns,
                "flag_ns": st.flag_ns,
                "streams": len(st.streams),
            }
            t.write(response("200 OK", json.dumps(stats).encode()))
        else:
            t.write(NOT_FOUND)

    def op_done(self, sleep: bool) -> None:
        st = self.state
        st.sleeping = sleep
        if not sleep:
            st.wake_done_ns = time.monotonic_ns()
            st.flag_ns = st.flags_after_wake = 0
        self.busy = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(OK_EMPTY)
            if self.buf:
                self.data_received(b"")

    def completion_done(self) -> None:
        self.busy = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(OK_COMPLETION)
            if self.buf:
                self.data_received(b"")

    def stream_done(self) -> None:
        self.busy = False
        if self.buf:
            self.data_received(b"")


def write_event(stream: Stream) -> None:
    body = EVENT_HEAD + b"%d}\n\n" % time.monotonic_ns()
    stream.left -= 1
    if stream.left <= 0:
        stream.transport.write(b"%x\r\n%s\r\n%s" % (len(body), body, DONE_CHUNK))
    else:
        stream.transport.write(b"%x\r\n%s\r\n" % (len(body), body))


async def ticker(st: State) -> None:
    """Writes every stream's events: `rate` events/s in all, round-robin, or as fast as sockets drain."""
    owed = 0.0
    last = time.monotonic()
    cursor = 0
    while True:
        if not st.streams:
            st.kick.clear()
            await st.kick.wait()
            last = time.monotonic()
            owed = 0.0
        if st.rate > 0:
            await asyncio.sleep(0.0005)
            now = time.monotonic()
            owed = min(owed + st.rate * (now - last), st.rate * 0.05)
            last = now
            budget = int(owed)
            owed -= budget
        else:
            await asyncio.sleep(0)
            budget = len(st.streams)
        streams = st.streams
        skipped = 0
        while budget > 0 and streams and skipped < len(streams):
            cursor %= len(streams)
            stream = streams[cursor]
            if stream.transport.is_closing():
                streams.pop(cursor)
                continue
            if stream.transport.get_write_buffer_size() > HIGH_WATER:
                cursor += 1
                skipped += 1
                continue
            skipped = 0
            write_event(stream)
            budget -= 1
            if stream.left <= 0:
                streams.pop(cursor)
                proto = stream.transport.get_protocol()
                if isinstance(proto, Conn):
                    proto.stream_done()
            else:
                cursor += 1


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--op-ms", type=float, default=10.0)
    args = parser.parse_args()
    st = State()
    st.rate = args.rate
    st.op_s = args.op_ms / 1000
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(st), "127.0.0.1", args.port, backlog=4096, reuse_address=True)
    async with server:
        await ticker(st)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
