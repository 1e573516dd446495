"""A keep-alive pool of raw HTTP/1.1 connections to one origin, responses framed by llhttp (httptools).

One pool per engine. A connection carries one exchange at a time: the exchange (a `ResponseSink`) writes its request
and gets the response as callbacks, then `release()`s or `close()`s the connection; no task per request. Idle
connections are reused newest first, never older than `keepalive_s` (uvicorn closes idle sockets after 5 s). At
most `max_connecting` are being opened at once, the rest waiting in arrival order; open ones are not capped unless
`max_connections` is set (a stream holds its connection for its whole generation). docs/design.md.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, cast

import httptools

from ..tasks import Tasks
from .failures import transport_failure

#: Connects at once by default: half the listen backlog vLLM's uvicorn asks for (2,048). The bound is what a burst of
#: new streams waits on (docs/performance.md, "What the code relies on", has the figure); the kernel caps every listen
#: queue at net.core.somaxconn, and handshakes past a full queue are dropped and retried a second later.
MAX_CONNECTING = 1024
#: Where the sidecar reads that cap: vLLM in the same pod shares its network namespace, and so the value.
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")

Connection = tuple[asyncio.BaseTransport, "UpstreamConnection"]
#: Opens one connection with the protocol the factory makes (loop.create_connection or create_unix_connection).
Connector = Callable[[Callable[[], "UpstreamConnection"]], Awaitable[Connection]]


class ResponseSink(Protocol):
    """The exchange a connection is lent to: told about the response as llhttp reads it, each read of the
    connection's between `begin_read` and `end_read` (what one read yields for the client goes out in one write)."""

    def begin_read(self) -> None: ...

    def end_read(self) -> None: ...

    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None: ...

    def response_body(self, data: bytes) -> None: ...

    def response_end(self) -> None: ...

    def upstream_lost(self, why: str) -> None:
        """The connection ended before the response was complete."""
        ...

    def crashed(self, where: str, exc: BaseException) -> None:
        """One of its own callbacks raised `exc` (a bug): end the exchange, answered (proxy/front/boundary.py)."""
        ...


class Waiter(Protocol):
    """An exchange waiting for a connection."""

    wants_connection: bool

    def connected(self, conn: UpstreamConnection) -> None: ...

    def connect_failed(self, why: str) -> None: ...

    def crashed(self, where: str, exc: BaseException) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "_pool",
        "_parser",
        "transport",
        "_sink",
        "_reason",
        "_headers",
        "_interim",
        "_head_only",
        "_head_seen",
        "_response_headers",
        "reusable",
        "idle_since",
        "closed",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._sink: ResponseSink | None = None
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._interim = False
        self._head_only = False
        self._head_seen = False
        self._response_headers: list[tuple[bytes, bytes]] = []
        self.reusable = False
        self.idle_since = 0.0
        self.closed = False

    # ----- the exchange's side
    def lend(self, sink: ResponseSink, *, head_only: bool = False) -> None:
        """`head_only`: the request was HEAD, whose response has headers and no body (llhttp cannot be told)."""
        self._sink = sink
        self._head_only = head_only
        self._head_seen = False
        self.reusable = False

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def release(self) -> None:
        """The exchange is over (request sent, response read): back to the pool, or closed if it cannot be reused."""
        self._sink = None
        if self.reusable and not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._pool._release(self)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection: vLLM aborts a request whose connection closes."""
        self._sink = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self._pool._forget(self)

    # ----- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport; they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._sink is None:
            # Nothing was asked: an idle connection that speaks is not one to trust with the next request.
            self.close()
            return
        sink = self._sink
        sink.begin_read()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self.close()
            sink.crashed("upstream", exc.__context__ or exc)  # llhttp keeps our exception as the context
        except httptools.HttpParserError as exc:
            self.close()
            sink.upstream_lost(f"unreadable response: {exc}")
        try:
            sink.end_read()  # the sink's, even once the response ended in this read and the connection was lent on
        except Exception as exc:
            if self._sink is sink:
                self.close()
            sink.crashed("upstream", exc)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        sink, self._sink = self._sink, None
        if not self.closed:
            self.closed = True
            self._pool._forget(self)
        if sink is None:
            return
        try:
            if self._head_seen and not self._framed():
                sink.response_end()  # a response delimited by the end of the connection
            else:
                lost = f": {transport_failure(exc, self._pool.address)}" if exc else ""
                sink.upstream_lost(f"the connection closed mid-response{lost}")
        except Exception as bug:
            sink.crashed("upstream", bug)

    # ----- llhttp
    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (the request's Expect is answered by the front itself): not relayed.
            self._interim = True
            self._reason, self._headers = b"", []
            return
        reason, headers = self._reason, self._headers
        self._reason, self._headers = b"", []
        self._head_seen = True
        self._response_headers = headers
        if self._sink is not None:
            self._sink.response_head(status, reason, headers)
        if self._head_only and self._sink is not None:
            # The parser would wait for the body the headers announce; the exchange ends here, the
            # connection with it.
            sink, self._sink = self._sink, None
            self.reusable = False
            sink.response_end()

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink.response_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        # uvicorn closes the connection after a 500 from an unhandled exception without saying so
        # (docs/real-vllm.md): reusing it would be a reset on the next request.
        self.reusable = self._parser.should_keep_alive() and self._parser.get_status_code() < 500
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.response_end()

    def _framed(self) -> bool:
        """Whether the response had a length or chunks (else its end is the connection's end)."""
        for name, value in self._response_headers:
            lowered = name.lower()
            if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False


def default_max_connecting(somaxconn: Path = SOMAXCONN) -> int:
    """`upstream_max_connecting` when it is not set: MAX_CONNECTING, or the kernel's cap on a listen queue where
    that is lower (128 before Linux 5.4); 128, the smallest a kernel gives, where the cap cannot be read."""
    try:
        return max(1, min(MAX_CONNECTING, int(somaxconn.read_text())))
    except (OSError, ValueError):
        return 128


class UpstreamPool:
    def __init__(
        self,
        connect: Connector,
        *,
        max_connections: int,
        max_connecting: int,
        keepalive_s: float,
        connect_timeout_s: float,
        name: str,
        address: str,
    ) -> None:
        self._connect = connect
        self.address = address  # host:port, for errors a person reads
        self._max = max_connections or None
        self._max_connecting = max_connecting
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._name = name
        self._idle: list[UpstreamConnection] = []
        self._waiting: collections.deque[Waiter] = collections.deque()
        self._open = 0
        self._connecting = 0
        self._tasks = Tasks()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def connecting(self) -> int:
        """Connections being opened now."""
        return self._connecting

    def _may_open(self) -> bool:
        return self._connecting < self._max_connecting and (self._max is None or self._open < self._max)

    def acquire(self, waiter: Waiter) -> None:
        """Hand `waiter` a connection now if one is idle, else once one is opened or given back."""
        now = time.monotonic()  # the loop's clock (asyncio's and uvloop's), read without looking the loop up
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or now - conn.idle_since > self._keepalive_s:
                conn.close()
                continue
            _hand(waiter, conn)
            return
        if self._closed:
            waiter.connect_failed(f"the {self._name} pool is closed")
        elif self._may_open():
            self._open_for(waiter)
        else:
            self._waiting.append(waiter)

    def _open_for(self, waiter: Waiter) -> None:
        self._open += 1
        self._connecting += 1
        self._tasks.spawn(self._open_connection(waiter), name=f"connect-{self._name}")

    async def _open_connection(self, waiter: Waiter) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await self._connect(lambda: UpstreamConnection(self))
        except (OSError, TimeoutError) as exc:
            self._open -= 1
            self._connecting -= 1
            if isinstance(exc, TimeoutError):
                why = f"no connection to {self.address} within {self._connect_timeout_s:g} s"
            else:
                why = transport_failure(exc, self.address)
            if waiter.wants_connection:
                try:
                    waiter.connect_failed(why)
                except Exception as exc:
                    waiter.crashed("upstream", exc)
            self._next_waiter()
            return
        self._connecting -= 1
        if waiter.wants_connection:
            _hand(waiter, conn)
        else:
            conn.reusable = True
            conn.release()
        self._next_waiter()

    def _release(self, conn: UpstreamConnection) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if waiter.wants_connection:
                _hand(waiter, conn)
                return
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive_s, self._expire_idle)

    def _forget(self, conn: UpstreamConnection) -> None:
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._next_waiter()

    def _next_waiter(self) -> None:
        while self._waiting and self._may_open() and not self._closed:
            waiter = self._waiting.popleft()
            if waiter.wants_connection:
                self._open_for(waiter)

    def _expire_idle(self) -> None:
        self._sweep = None
        now = time.monotonic()
        expired = [conn for conn in self._idle if now - conn.idle_since > self._keepalive_s]
        for conn in expired:
            conn.close()
        if self._idle:
            oldest = min(conn.idle_since for conn in self._idle)
            self._sweep = asyncio.get_running_loop().call_at(oldest + self._keepalive_s + 0.01, self._expire_idle)

    async def close(self) -> None:
        """Close idle connections and refuse new exchanges; connections lent out close when their exchange ends."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._idle):
            conn.close()
        while self._waiting:
            waiter = self._waiting.popleft()
            if waiter.wants_connection:
                waiter.connect_failed(f"the {self._name} pool is closed")
        await self._tasks.close()


def _hand(waiter: Waiter, conn: UpstreamConnection) -> None:
    try:
        waiter.connected(conn)
    except Exception as exc:
        waiter.crashed("forward", exc)
