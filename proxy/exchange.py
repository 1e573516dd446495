"""One request through the raw front (proxy/front.py): sent on a pooled upstream connection, its response
relayed back to the client as llhttp reads it.

Three kinds share the relay:
* `FastExchange`: an inference request the gate admitted at once, sent to vLLM with the framing rules of
  proxy/forward.py (hop-by-hop headers and `Connection` tokens dropped, the admin token header dropped, no
  `X-Forwarded-For`, the body with its length). Registered in `InFlightRequests` so a level-2 sleep ends it.
* `HeldExchange`: an inference request the gate holds, parked in its queue as parsed bytes; admitted, a
  `FastExchange`.
* `SeamExchange`: anything else, relayed unchanged to the aiohttp application (proxy/seam.py), which
  guards or forwards it as it always did; its body streams as it arrives.

Back-pressure: while the client's transport is over its high-water mark the upstream connection stops
being read; a request body stops being read from the client while the upstream's send buffer is full. A
client that leaves closes the upstream connection, which is what makes vLLM abort the generation.
Everything here is plain callbacks: no task, future or coroutine per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .errors import LifeguardError, UpstreamUnreachable
from .forward import HOP_BY_HOP, relative_location, sse_error_event
from .gate import Parked, RequestGate, Ticket
from .handlers import GATE_OUTCOMES, render_error_bytes
from .inflight import AbortedBySleep, InFlightRequests, sse_abort_event
from .metrics import Metrics
from .request_reader import ParsedRequest
from .upstream_pool import UpstreamConnection, UpstreamPool

log = logging.getLogger("lifeguard.forward")
log_http = logging.getLogger("lifeguard.http")  # where the aiohttp handlers log a request not forwarded

_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP) | {b"expect"}
# What the front itself frames towards the client; the seam's other headers are relayed as they are.
_FRAMING = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"proxy-connection"})
_NO_BODY_STATUS = frozenset({204, 304})
_END_CHUNKS = b"0\r\n\r\n"
_STALE = (b"X-Lifeguard-Weights-Stale", b"true")


class ClientSide(Protocol):
    """The client connection an exchange answers on (proxy/front.py)."""

    transport: asyncio.Transport
    writing_paused: bool

    def exchange_done(self, exchange: Exchange, *, close: bool) -> None: ...

    def replace_exchange(self, old: Exchange, new: Exchange) -> None: ...

    def upload_paused(self, paused: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class Upstreams:
    """What every exchange of one proxy shares."""

    vllm: UpstreamPool
    seam: UpstreamPool
    host: bytes  # the Host header vLLM gets, as aiohttp's client would send it
    basic_auth: bytes | None  # from credentials in the upstream URL, as aiohttp's client would send them
    origins: tuple[str, ...]  # vLLM's own address, for making its redirects relative
    inflight: InFlightRequests
    metrics: Metrics


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Exchange:
    """What every kind shares: waiting for a connection, the response head and body to the client."""

    def __init__(self, client: ClientSide, request: ParsedRequest) -> None:
        self.client = client
        self.request = request
        self.conn: UpstreamConnection | None = None
        self.wants_connection = True
        self.finished = False
        self.head_sent = False
        self._framing = b""  # b"length", b"chunked", b"close" or b"" (no body)
        self.close_client = not request.keep_alive

    # ----- what each kind does (pool waiter and response sink, proxy/upstream_pool.py)
    def start(self) -> None:
        raise NotImplementedError

    def connected(self, conn: UpstreamConnection) -> None:
        raise NotImplementedError

    def connect_failed(self, why: str) -> None:
        raise NotImplementedError

    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        raise NotImplementedError

    def response_body(self, data: bytes) -> None:
        raise NotImplementedError

    def response_end(self) -> None:
        raise NotImplementedError

    def upstream_lost(self, why: str) -> None:
        raise NotImplementedError

    # ----- the client's side
    def client_writable(self, writable: bool) -> None:
        if self.conn is not None:
            if writable:
                self.conn.resume_reading()
            else:
                self.conn.pause_reading()

    def client_gone(self) -> None:
        self.wants_connection = False
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def upstream_writable(self, writable: bool) -> None:
        self.client.upload_paused(not writable)

    # ----- the response
    def _attach(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        conn.lend(self, head_only=self.request.method == b"HEAD")
        if self.client.writing_paused:
            conn.pause_reading()

    def _head(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], drop: frozenset[bytes], *, seam: bool
    ) -> bytes:
        """The response head for the client: `headers` minus `drop`, framed for this client; `seam`: the
        application's `Connection: close` (a body left on the wire) closes the client's connection too."""
        lines = [b"HTTP/1.1 %d %b" % (status, reason)]
        has_length = False
        for name, value in headers:
            lowered = name.lower()
            if lowered in drop:
                if seam and lowered == b"connection" and b"close" in value.lower():
                    self.close_client = True
                continue
            if lowered == b"content-length":
                has_length = True
            lines.append(name + b": " + value)
        if self.request.method == b"HEAD" or status in _NO_BODY_STATUS or status < 200:
            self._framing = b""
        elif has_length:
            self._framing = b"length"
        elif self.request.version == "1.0":
            self._framing, self.close_client = b"close", True
        else:
            self._framing = b"chunked"
            lines.append(b"Transfer-Encoding: chunked")
        if self.close_client:
            lines.append(b"Connection: close")
        elif self.request.version == "1.0":
            lines.append(b"Connection: keep-alive")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _write_body(self, data: bytes) -> None:
        if self._framing == b"chunked":
            if data:
                self.client.transport.write(_chunk(data))
        elif self._framing:
            self.client.transport.write(data)

    def _end_body(self) -> None:
        if self._framing == b"chunked":
            self.client.transport.write(_END_CHUNKS)

    def _answer_error(self, error: LifeguardError) -> None:
        self.close_client = self.close_client or error.close_connection
        self.client.transport.write(render_error_bytes(error, close=self.close_client))
        self.head_sent = True


class FastExchange(Exchange):
    """An admitted inference request to vLLM (the ticket is the gate's in-flight count)."""

    def __init__(
        self,
        client: ClientSide,
        request: ParsedRequest,
        upstreams: Upstreams,
        ticket: Ticket,
        target: bytes,
        *,
        stale: bool,
    ) -> None:
        super().__init__(client, request)
        self._up = upstreams
        self._ticket = ticket
        self._target = target
        self._stale = stale
        self._sent_at = 0.0
        self._buffer: list[bytes] | None = None  # a response with a length, sent whole (as forward.py did)
        self._sse = False
        self.upstream_done = False

    def start(self) -> None:
        self._up.inflight.add(self)
        self._up.vllm.acquire(self)

    def _request_bytes(self) -> bytes:
        request = self.request
        drop = _HOP_BY_HOP | request.connection_tokens
        lines = [b"%b %b HTTP/1.1" % (request.method, self._target), b"Host: " + self._up.host]
        authorization = False
        for name, value in request.headers:
            lowered = name.lower()
            if lowered not in drop:
                lines.append(name + b": " + value)
                authorization = authorization or lowered == b"authorization"
        if self._up.basic_auth is not None and not authorization:
            lines.append(b"Authorization: " + self._up.basic_auth)
        body = b"".join(request.body)
        if body or request.method not in (b"GET", b"HEAD"):
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    # ----- pool waiter
    def connected(self, conn: UpstreamConnection) -> None:
        if not self.wants_connection:
            conn.reusable = True
            conn.release()
            return
        self._attach(conn)
        self._sent_at = time.monotonic()
        conn.write(self._request_bytes())

    def connect_failed(self, why: str) -> None:
        self._answer_error(UpstreamUnreachable(f"vLLM could not be reached: {why}"))
        self._finish("upstream_unreachable")

    # ----- response sink
    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self._up.metrics.upstream_latency(time.monotonic() - self._sent_at)
        drop = _HOP_BY_HOP - {b"content-length"}
        relayed: list[tuple[bytes, bytes]] = []
        has_length = False
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"connection":
                drop = drop | {token.strip().lower() for token in value.split(b",")}
            elif lowered == b"location":
                value = relative_location(value.decode("latin-1"), self._up.origins).encode("latin-1")
            elif lowered == b"content-type" and b"text/event-stream" in value.lower():
                self._sse = True
            elif lowered == b"content-length":
                has_length = True
            relayed.append((name, value))
        if self._stale:
            relayed.append(_STALE)
        head = self._head(status, reason, relayed, drop, seam=False)
        if has_length and not self._sse:
            self._buffer = [head]
        else:
            self.client.transport.write(head)
            self.head_sent = True

    def response_body(self, data: bytes) -> None:
        if self._buffer is not None:
            self._buffer.append(data)
        else:
            self._write_body(data)

    def response_end(self) -> None:
        self.upstream_done = True
        if self._buffer is not None:
            self.client.transport.write(b"".join(self._buffer))
            self.head_sent = True
        else:
            self._end_body()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.release()
        self._finish("forwarded")

    def upstream_lost(self, why: str) -> None:
        self.conn = None
        if not self.head_sent:
            self._answer_error(UpstreamUnreachable(f"vLLM could not be reached: {why}"))
            self._finish("upstream_unreachable")
            return
        log.warning("stream from vLLM broke mid-way", extra={"event": "stream_broken"})
        self._end_stream(sse_error_event(f"the upstream stream broke: {why}"))
        self._finish("stream_broken")

    def _end_stream(self, sse_event: bytes) -> None:
        """An SSE stream ends with an error event and its last chunk; any other started response cannot carry an
        error, so its connection is dropped (a broken response, never a silently truncated one)."""
        if self._sse and self._framing == b"chunked":
            self._write_body(sse_event)
            self._end_body()
        else:
            self.close_client = True
            self.client.transport.abort()

    # ----- in flight (proxy/inflight.py)
    def abort(self, message: str) -> bool:
        if self.upstream_done or self.finished:
            return False
        self.wants_connection = False
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        error = AbortedBySleep(message)
        if not self.head_sent:
            self._answer_error(error)
        else:
            self._end_stream(sse_abort_event(error))
        self._finish("aborted_by_sleep")
        return True

    async def wait_ended(self) -> None:
        return None  # `abort` ends the exchange before it returns

    def client_gone(self) -> None:
        if not self.finished:
            super().client_gone()
            self._finish("client_gone", notify=False)

    def _finish(self, outcome: str, *, notify: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        self._ticket.done()
        self._up.inflight.discard(self)
        metrics = self._up.metrics
        metrics.inference_finished(outcome)
        metrics.request_duration("inference", time.monotonic() - self.request.started)
        if notify:
            self.client.exchange_done(self, close=self.close_client)


class SeamExchange(Exchange):
    """A request for the aiohttp application, relayed as received (bar `Expect`, which the front answers)."""

    def __init__(self, client: ClientSide, request: ParsedRequest, upstreams: Upstreams) -> None:
        super().__init__(client, request)
        self._up = upstreams
        self._sent_pieces = 0
        self._sent_end = False
        self.response_done = False

    def start(self) -> None:
        self._up.seam.acquire(self)

    # ----- pool waiter
    def connected(self, conn: UpstreamConnection) -> None:
        if not self.wants_connection:
            conn.reusable = True
            conn.release()
            return
        self._attach(conn)
        request = self.request
        lines = [b"%b %b HTTP/%b" % (request.method, request.url, request.version.encode())]
        lines += [name + b": " + value for name, value in request.headers if name.lower() != b"expect"]
        conn.write(b"\r\n".join(lines) + b"\r\n\r\n")
        self.send_body()

    def connect_failed(self, why: str) -> None:
        log.error("the proxy's own application could not be reached: %s", why)
        self._answer_error(LifeguardError("the proxy could not reach its own control plane; see its log"))
        self.close_client = True
        self._done()

    def send_body(self) -> None:
        """Relay the body received so far (called by the front as more arrives)."""
        conn, request = self.conn, self.request
        if conn is None or self._sent_end:
            return
        pieces = request.body
        while self._sent_pieces < len(pieces):
            piece = pieces[self._sent_pieces]
            self._sent_pieces += 1
            conn.write(_chunk(piece) if request.chunked and piece else piece)
        if request.complete:
            self._sent_end = True
            request.body.clear()
            self._sent_pieces = 0
            if request.chunked:
                conn.write(_END_CHUNKS)
            if self.response_done:
                self._done()

    # ----- response sink
    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.client.transport.write(self._head(status, reason, headers, _FRAMING, seam=True))
        self.head_sent = True

    def response_body(self, data: bytes) -> None:
        self._write_body(data)

    def response_end(self) -> None:
        self._end_body()
        self.response_done = True
        if self._sent_end or self.close_client:
            self._done()

    def client_gone(self) -> None:
        super().client_gone()
        self.finished = True

    def upstream_lost(self, why: str) -> None:
        # The application closed the connection without a (whole) answer: so does the front, as aiohttp did.
        self.conn = None
        self.close_client = True
        self.client.transport.abort()
        self._done()

    def _done(self) -> None:
        if self.finished:
            return
        self.finished = True
        conn, self.conn = self.conn, None
        if conn is not None:
            if self._sent_end:
                conn.release()
            else:
                conn.close()
        self.client.exchange_done(self, close=self.close_client)


class HeldExchange(Exchange):
    """An inference request the gate holds (`RequestGate.park`): only its parsed bytes and callbacks wait.
    Admitted, it goes on as a `FastExchange` on the same client connection; refused (deadline, queue full,
    engine failed, shutdown), it is answered with the gate's error, as the aiohttp handler answered it."""

    def __init__(
        self,
        client: ClientSide,
        request: ParsedRequest,
        upstreams: Upstreams,
        gate: RequestGate,
        target: bytes,
        stale: Callable[[], bool],
    ) -> None:
        super().__init__(client, request)
        self._up = upstreams
        self._gate = gate
        self._target = target
        self._stale = stale
        self._parked: Parked | None = None

    def start(self) -> None:
        try:
            self._parked = self._gate.park(self, self.request.body_size)
        except LifeguardError as exc:
            self.refused(exc)

    def admitted(self, ticket: Ticket) -> None:
        self._parked = None
        self.finished = True
        fast = FastExchange(self.client, self.request, self._up, ticket, self._target, stale=self._stale())
        self.client.replace_exchange(self, fast)
        fast.start()

    def refused(self, error: LifeguardError) -> None:
        self._parked = None
        self._not_forwarded(error.reason if error.reason in GATE_OUTCOMES else "engine_unavailable")
        self._answer_error(error)
        self.finished = True
        self.client.exchange_done(self, close=self.close_client)

    def client_gone(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None and not self.finished:
            parked.cancel()
            self._not_forwarded("client_gone")
        self.finished = True

    def _not_forwarded(self, outcome: str) -> None:
        request = self.request
        held_s = time.monotonic() - request.started
        metrics = self._up.metrics
        metrics.inference_finished(outcome)
        metrics.request_duration("inference", held_s)
        request_id = next((value for name, value in request.headers if name.lower() == b"x-request-id"), None)
        log_http.info(
            "request not forwarded: %s",
            outcome,
            extra={
                "event": "hold_ended",
                "reason": outcome,
                "path": request.url.split(b"?", 1)[0].decode("latin-1"),
                "held_s": round(held_s, 4),
                "request_id": request_id.decode("latin-1") if request_id is not None else None,
            },
        )
