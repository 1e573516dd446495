"""One request on a client connection, from the moment it is decided to its answer.

* `Forward`: sent to an engine's vLLM on a pooled connection (upstream/pool.py) and its answer relayed back; an
  answer that is vLLM refusing for its own state (upstream/refusals.py) goes back to the gate instead.
* `Answered`, `SerializedForward` (answered.py): what the proxy answers itself; a control call that waits for the
  lifecycle lock.
* `HeldExchange` (held.py): an inference request the gate holds.
Each kind counts its own ending once and catches its own bugs (boundary.py). docs/design.md tells the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import AbortedBySleep, LifeguardError, StreamBroken, UpstreamUnreachable
from ..lifecycle.engine import Engine
from ..lifecycle.gate import Ticket
from ..upstream.pool import UpstreamConnection
from ..upstream.refusals import REFUSAL_STATUS, Pending, Refusal, response_refusal, stream_refusal
from .boundary import caught
from .request_reader import ParsedRequest
from .versioned import VersionStamp, with_length
from .wire import (
    END_CHUNKS,
    HOP_BY_HOP,
    Answer,
    answer_bytes,
    chunk,
    error_answer,
    relative_location,
    sse_error_event,
)

log = logging.getLogger("lifeguard.forward")

_NO_BODY_STATUS = frozenset({204, 304})
# A response's own framing is replaced by the proxy's, except its Content-Length, which is kept.
_RESPONSE_HOP_BY_HOP = HOP_BY_HOP - {b"content-length"}
_CONNECTION_OPTIONS = frozenset({b"keep-alive", b"close"})
_STALE = b"X-Lifeguard-Weights-Stale: true"
# An answer with a length up to this size is sent to the client in one write with its head; a larger one streams.
_WHOLE_UP_TO = 1 << 16
# How often one request goes back to the gate after vLLM refused it for its own state; then vLLM's answer is relayed
# (a pause the flags cannot show, taken back each time, must not loop a request for ever).
_REHOLDS = 3


class Exchange(Protocol):
    """What the front sees of any kind."""

    request: ParsedRequest
    head_sent: bool

    def start(self) -> None: ...

    def client_writable(self, writable: bool) -> None:
        """The client's transport went over (False) or back under (True) its high-water mark."""
        ...

    def client_gone(self) -> None:
        """The client's connection is gone: stop, and tell the front nothing."""
        ...


class ClientSide(Protocol):
    """The client connection an exchange answers on (proxy/front/connection.py)."""

    transport: asyncio.Transport
    writing_paused: bool

    def exchange_done(self, exchange: Exchange, *, close: bool) -> None: ...

    def replace_exchange(self, old: Exchange, new: Exchange) -> None: ...

    def back_to_the_gate(self, old: Exchange, engine: Engine, refusal: Refusal) -> None:
        """vLLM refused `old`'s inference request for the engine's own state: it goes through `engine`'s gate
        again once the coordinator has adopted that state."""
        ...


class Answering:
    """What every kind shares: the request, the client connection it is answered on, and how an answer, an
    error, or the end of a started stream is written."""

    __slots__ = ("client", "request", "finished", "head_sent", "close_client", "_framing", "_sse")

    def __init__(self, client: ClientSide, request: ParsedRequest) -> None:
        self.client = client
        self.request = request
        self.finished = False
        self.head_sent = False
        self.close_client = not request.keep_alive
        self._framing = b""  # b"length", b"chunked", b"close" or b"" (no body), once a head is sent
        self._sse = False

    def _answer(self, answer: Answer) -> None:
        request = self.request
        self.client.transport.write(
            answer_bytes(
                answer, close=self.close_client, http10=request.version == "1.0", head_only=request.method == b"HEAD"
            )  # fmt: skip
        )
        self.head_sent = True

    def _answer_error(self, error: LifeguardError) -> None:
        self.close_client = self.close_client or error.close_connection
        self._answer(error_answer(error))

    def _end_with(self, error: LifeguardError) -> None:
        """`error` for a request whose answer may have begun: the error answer, else (an SSE stream) the same
        error as its last event; any other started answer cannot carry an error, so its connection is dropped."""
        if not self.head_sent:
            self._answer_error(error)
        elif self._sse and self._framing == b"chunked":
            self.client.transport.write(chunk(sse_error_event(error)) + END_CHUNKS)
        else:
            self.close_client = True
            self.client.transport.abort()


class Forward(Answering):
    """A request sent to `engine`'s vLLM at `target` (origin-form, as classified): the pool's waiter and the
    connection's response sink. `ticket`: an admitted inference request (counted, abortable); `drop`: the
    header that carried the admin token; `on_end`: told once, however it ends."""

    __slots__ = (
        "_engine",
        "_target",
        "_ticket",
        "_stale",
        "_drop",
        "_on_end",
        "_on_answer",
        "_rewrite",
        "conn",
        "wants_connection",
        "upstream_done",
        "_sent_at",
        "_buffer",
        "_status",
        "_headers",
        "_probe",
        "_reading",
        "_out",
        "_stamp",
    )

    def __init__(
        self,
        client: ClientSide,
        request: ParsedRequest,
        engine: Engine,
        target: bytes,
        *,
        ticket: Ticket | None = None,
        stale: bool = False,
        drop: frozenset[bytes] = frozenset(),
        on_end: Callable[[], None] | None = None,
        on_answer: Callable[[int, bytes], bytes | None] | None = None,
        rewrite: Callable[[int, bytes], bytes | None] | None = None,
    ) -> None:
        super().__init__(client, request)
        self._engine = engine
        self._target = target
        self._ticket = ticket
        self._stale = stale
        self._drop = drop
        self._on_end = on_end
        self._on_answer = on_answer
        self._rewrite = rewrite  # a whole answer's body as the client gets it (None: as vLLM sent it)
        self.conn: UpstreamConnection | None = None
        self.wants_connection = True
        self.upstream_done = False
        self._sent_at = 0.0
        self._buffer: list[bytes] | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        # An inference stream's head and first bytes, kept back until they show it is not vLLM's refusal.
        self._probe: list[bytes] | None = None
        # While llhttp parses one read of vLLM's (begin_read .. end_read), what it yields for the client is gathered
        # here and written once at its end: one system call per read, not one per event (docs/performance.md).
        self._reading = False
        self._out: list[bytes] = []
        # Inference: the weight version it was dispatched on, and what its answer says of it (versioned.py).
        self._stamp = VersionStamp(engine.versions, request.whole_body()) if ticket is not None else None

    def start(self) -> None:
        if self._ticket is not None:
            self._engine.inflight.add(self)
        self._engine.upstream.pool.acquire(self)

    def _request_bytes(self) -> bytes:
        request, upstream = self.request, self._engine.upstream
        drop = HOP_BY_HOP
        if request.connection_tokens or self._drop:
            drop = drop | request.connection_tokens | self._drop
        lines = [b"%b %b HTTP/1.1\r\nHost: %b" % (request.method, self._target, upstream.host)]
        basic_auth = upstream.basic_auth
        authorization = basic_auth is None  # looked for only when the proxy would add its own
        for name, value in request.headers:
            lowered = name.lower()
            if lowered not in drop:
                lines.append(name + b": " + value)
                authorization = authorization or lowered == b"authorization"
        if basic_auth is not None and not authorization:
            lines.append(b"Authorization: " + basic_auth)
        body = request.whole_body()
        if self._ticket is not None and request.route is not None:
            body = self._engine.body_to_send(request.route.path, body)
        if self._stamp is not None and self._stamp.asked:
            body = self._stamp.request_body(body)
        if body or request.method not in (b"GET", b"HEAD"):
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    # ----- pool waiter
    def connected(self, conn: UpstreamConnection) -> None:
        if not self.wants_connection:
            conn.reusable = True
            conn.release()
            return
        conn.lend(self, head_only=self.request.method == b"HEAD")
        self.conn = conn
        if self.client.writing_paused:
            conn.pause_reading()
        self._sent_at = time.monotonic()
        conn.write(self._request_bytes())

    def connect_failed(self, why: str) -> None:
        self._end_with(UpstreamUnreachable(f"vLLM could not be reached: {why}"))
        self._finish("upstream_unreachable")

    # ----- response sink
    def begin_read(self) -> None:
        self._reading = True
        if self._ticket is not None:
            self._engine.inflight.progressed()

    def end_read(self) -> None:
        self._flush_with(b"")

    def _send(self, data: bytes) -> None:
        if self._reading:
            self._out.append(data)
        else:
            self.client.transport.write(data)

    def _flush_with(self, last: bytes) -> None:
        """What this read gathered, then `last`, in one write now: at an exchange's end the client connection's
        next answer may follow at once."""
        self._reading = False
        out = self._out
        if out:
            if last:
                out.append(last)
            last = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
        if last:
            self.client.transport.write(last)

    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self._engine.metrics.upstream_latency(time.monotonic() - self._sent_at)
        lines = [b"HTTP/1.1 %d %b" % (status, reason)]
        length: int | None = None
        listed: set[bytes] = set()  # what a Connection header names beyond keep-alive and close: dropped too
        for name, value in headers:
            lowered = name.lower()
            if lowered in _RESPONSE_HOP_BY_HOP:
                if lowered == b"connection" and value.lower() not in _CONNECTION_OPTIONS:
                    listed |= {token.strip().lower() for token in value.split(b",")} - _CONNECTION_OPTIONS
                continue
            if lowered == b"content-length":
                length = int(value)  # llhttp admits digits only
            elif lowered == b"content-type" and b"text/event-stream" in value.lower():
                self._sse = True
            elif lowered == b"location":
                value = relative_location(value, self._engine.upstream.origins)
            lines.append(name + b": " + value)
        if listed:
            lines[1:] = [line for line in lines[1:] if line.partition(b":")[0].lower() not in listed]
        request = self.request
        if self._stale:
            lines.append(_STALE)
        stamp = self._stamp
        if stamp is not None:
            lines.append(stamp.header_line)
        if request.method == b"HEAD" or status in _NO_BODY_STATUS or status < 200:
            self._framing = b""
        elif length is not None:
            self._framing = b"length"
        elif request.version == "1.0":
            self._framing, self.close_client = b"close", True
        else:
            self._framing = b"chunked"
            lines.append(b"Transfer-Encoding: chunked")
        if self.close_client:
            lines.append(b"Connection: close")
        elif request.version == "1.0":
            lines.append(b"Connection: keep-alive")
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        self._status, self._headers = status, headers
        if length is not None and (length <= _WHOLE_UP_TO or (stamp is not None and stamp.asked)) and not self._sse:
            self._buffer = [head]
        elif self._may_refuse() and self._sse and status == 200:
            self._probe = [head, b""]
        else:
            self._send(head)
            self.head_sent = True

    def _may_refuse(self) -> bool:
        """An inference request that may still go back to the gate if vLLM refuses it for its own state."""
        return self._ticket is not None and self.request.reholds < _REHOLDS

    def response_body(self, data: bytes) -> None:
        if self._buffer is not None:
            self._buffer.append(data)
            return
        if self._probe is not None:
            self._probe[1] += data
            verdict = stream_refusal(self._status, self._headers, self._probe[1])
            if verdict is Pending.MORE:
                return
            if isinstance(verdict, Refusal):
                self._back_to_the_gate(verdict)
                return
            self._flush_probe()
            return
        self._write_body(data)

    def _flush_probe(self) -> None:
        """The stream is not a refusal: its head and what was kept back go out, together."""
        assert self._probe is not None
        head, kept = self._probe
        self._probe = None
        self.head_sent = True
        if kept and self._stamp is not None:
            kept = self._stamp.stream(kept)
        if kept and self._framing:
            head += chunk(kept) if self._framing == b"chunked" else kept
        self._send(head)

    def _write_body(self, data: bytes) -> None:
        if self._stamp is not None:
            data = self._stamp.stream(data)
        self._write_framed(data)

    def _write_framed(self, data: bytes) -> None:
        if self._framing == b"chunked":
            if not data:
                return
            data = chunk(data)
        elif not self._framing:
            return
        self._send(data)

    def response_end(self) -> None:
        if self._buffer is not None and self._status == REFUSAL_STATUS and self._may_refuse():
            refusal = response_refusal(self._status, self._headers, b"".join(self._buffer[1:]))
            if refusal is not None:
                self._back_to_the_gate(refusal, reusable=True)
                return
        if self._probe is not None:
            self._flush_probe()
        self.upstream_done = True
        if self._buffer is not None:
            line = self._on_answer(self._status, b"".join(self._buffer[1:])) if self._on_answer is not None else None
            if line is not None:  # a header line the answer's reader adds, before the head's blank line
                self._buffer[0] = self._buffer[0][:-2] + line + b"\r\n\r\n"
            if self._rewrite is not None and (body := self._rewrite(self._status, b"".join(self._buffer[1:]))):
                self._buffer[:] = [with_length(self._buffer[0], body), body]
            if self._stamp is not None:
                self._buffer[:] = self._stamp.whole(self._buffer[0], b"".join(self._buffer[1:]))
            self._flush_with(b"".join(self._buffer))
            self._buffer = None
            self.head_sent = True
        else:
            if self._stamp is not None and (tail := self._stamp.stream_end()):
                self._write_framed(tail)
            self._flush_with(END_CHUNKS if self._framing == b"chunked" else b"")
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.release()
        self._finish("forwarded")

    def _back_to_the_gate(self, refusal: Refusal, *, reusable: bool = False) -> None:
        """vLLM refused this request for the engine's own state: nothing of its answer goes out."""
        conn, self.conn = self.conn, None
        if conn is not None:
            if reusable:
                conn.release()
            else:
                conn.close()  # the rest of a refused stream ([DONE]) is not wanted
        self.wants_connection = False
        self._buffer = self._probe = None
        self.finished = True
        assert self._ticket is not None
        self._ticket.done()
        self._engine.inflight.discard(self)
        log.info(
            "vLLM refused a forwarded request (%s: %s); it is held again",
            refusal.kind,
            refusal.message,
            extra={"event": "engine_refused", "engine": self._engine.name, "reason": str(refusal.kind)},
        )
        self.client.back_to_the_gate(self, self._engine, refusal)

    def upstream_lost(self, why: str) -> None:
        self.conn = None
        self._buffer = None
        if self._probe is not None:  # what was kept back goes out before the error event that ends it
            self._flush_probe()
        self._flush_with(b"")
        if not self.head_sent:
            self._end_with(UpstreamUnreachable(f"vLLM could not be reached: {why}"))
            self._finish("upstream_unreachable")
            return
        log.warning("stream from vLLM broke mid-way", extra={"event": "stream_broken"})
        self._end_with(StreamBroken(f"the upstream stream broke: {why}"))
        self._finish("stream_broken")

    def fail(self, error: LifeguardError, outcome: str) -> None:
        """End this request now with `error`, whatever stage it is at (its upstream connection closed)."""
        self._drop_upstream()
        self._buffer = None
        if self._probe is not None and not self.finished:
            self._flush_probe()
        self._flush_with(b"")
        if not self.finished:
            self._end_with(error)
            self._finish(outcome)

    def crashed(self, where: str, exc: BaseException) -> None:
        """A bug in one of this request's callbacks (proxy/front/boundary.py): it ends here, answered."""
        self.fail(caught(where, exc, self._engine.metrics.proxy_error), "proxy_error")

    # ----- the client's side
    def client_writable(self, writable: bool) -> None:
        if self.conn is not None:
            if writable:
                self.conn.resume_reading()
            else:
                self.conn.pause_reading()

    def client_gone(self) -> None:
        self._out.clear()
        if not self.finished:
            self._drop_upstream()
            self._finish("client_gone", notify=False)

    # ----- in flight (proxy/lifecycle/inflight.py)
    def abort(self, message: str) -> bool:
        if self.upstream_done or self.finished:
            return False
        self.fail(AbortedBySleep(message), "aborted_by_sleep")
        return True

    def _drop_upstream(self) -> None:
        self.wants_connection = False
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()

    def _finish(self, outcome: str, *, notify: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        metrics = self._engine.metrics
        seconds = time.monotonic() - self.request.started
        if self._ticket is not None:
            self._ticket.done()
            self._engine.inflight.discard(self)
            metrics.inference_finished(outcome, seconds)
            if self._stamp is not None:
                self._stamp.ended(metrics.versions, self._engine.name)
        else:
            metrics.request_duration("passthrough", seconds)
        if self._on_end is not None:
            self._on_end()
        if notify:
            self.client.exchange_done(self, close=self.close_client)
