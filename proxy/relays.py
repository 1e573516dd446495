"""The two exchanges on a pooled upstream connection (proxy/exchange.py): admitted inference to vLLM
(`FastExchange`), anything else to the aiohttp application (`SeamExchange`)."""

from __future__ import annotations

import logging
import time

from .errors import LifeguardError, UpstreamUnreachable
from .exchange import END_CHUNKS, ClientSide, Relay, Upstreams, chunk
from .forward import HOP_BY_HOP, relative_location, sse_error_event
from .gate import Ticket
from .inflight import AbortedBySleep, sse_abort_event
from .request_reader import ParsedRequest
from .upstream_pool import UpstreamConnection

log = logging.getLogger("lifeguard.forward")

_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP) | {b"expect"}
# What the front itself frames towards the client; the seam's other headers are relayed as they are.
_FRAMING = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"proxy-connection"})
_STALE = (b"X-Lifeguard-Weights-Stale", b"true")


class FastExchange(Relay):
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
        if not self._attach(conn, self):
            return
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


class SeamExchange(Relay):
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
        if not self._attach(conn, self):
            return
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
            conn.write(chunk(piece) if request.chunked and piece else piece)
        if request.complete:
            self._sent_end = True
            request.body.clear()
            self._sent_pieces = 0
            if request.chunked:
                conn.write(END_CHUNKS)
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
