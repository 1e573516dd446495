"""One request through the raw front (proxy/front.py), and what every kind of it shares.

Three kinds:
* `FastExchange` (proxy/relays.py): an inference request the gate admitted at once, sent to vLLM with the
  framing rules of proxy/forward.py (hop-by-hop headers and `Connection` tokens dropped, the admin token
  header dropped, no `X-Forwarded-For`, the body with its length). Registered in `InFlightRequests` so a
  level-2 sleep ends it.
* `HeldExchange` (proxy/held.py): an inference request the gate holds, parked in its queue as parsed bytes;
  admitted, a `FastExchange`.
* `SeamExchange` (proxy/relays.py): anything else, relayed unchanged to the aiohttp application
  (proxy/seam.py), which guards or forwards it as it always did; its body streams as it arrives.

`Answering` is what all three share; `Relay`, what the two on a pooled upstream connection share.
Back-pressure: while the client's transport is over its high-water mark the upstream connection stops
being read; a request body stops being read from the client while the upstream's send buffer is full. A
client that leaves closes the upstream connection, which is what makes vLLM abort the generation.
Everything here is plain callbacks: no task, future or coroutine per request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from .errors import LifeguardError
from .handlers import render_error_bytes
from .inflight import InFlightRequests
from .metrics import Metrics
from .request_reader import ParsedRequest
from .upstream_pool import ResponseSink, UpstreamConnection, UpstreamPool

_NO_BODY_STATUS = frozenset({204, 304})
END_CHUNKS = b"0\r\n\r\n"


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


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Answering:
    """What every kind shares: the request, the client connection it is answered on, and an error answer."""

    __slots__ = ("client", "request", "finished", "head_sent", "close_client")

    def __init__(self, client: ClientSide, request: ParsedRequest) -> None:
        self.client = client
        self.request = request
        self.finished = False
        self.head_sent = False
        self.close_client = not request.keep_alive

    def _answer_error(self, error: LifeguardError) -> None:
        self.close_client = self.close_client or error.close_connection
        self.client.transport.write(render_error_bytes(error, close=self.close_client))
        self.head_sent = True


class Relay(Answering):
    """An exchange on a pooled upstream connection: the pool's waiter and the connection's response sink
    (proxy/upstream_pool.py), whose hooks each kind implements (proxy/relays.py). Here: the connection,
    back-pressure both ways, and the response's head and body framed for the client."""

    def __init__(self, client: ClientSide, request: ParsedRequest) -> None:
        super().__init__(client, request)
        self.conn: UpstreamConnection | None = None
        self.wants_connection = True
        self._framing = b""  # b"length", b"chunked", b"close" or b"" (no body)

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
    def _attach(self, conn: UpstreamConnection, sink: ResponseSink) -> bool:
        """Take the connection the pool handed over, `sink` (the kind itself) hearing its response; False, and the
        connection back in the pool, when the client left while this exchange waited for it."""
        if not self.wants_connection:
            conn.reusable = True
            conn.release()
            return False
        conn.lend(sink, head_only=self.request.method == b"HEAD")
        self.conn = conn
        if self.client.writing_paused:
            conn.pause_reading()
        return True

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
                self.client.transport.write(chunk(data))
        elif self._framing:
            self.client.transport.write(data)

    def _end_body(self) -> None:
        if self._framing == b"chunked":
            self.client.transport.write(END_CHUNKS)
