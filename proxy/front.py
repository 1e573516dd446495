"""The raw front: the proxy's listening socket, served by an `asyncio.Protocol` with llhttp (httptools).

Each request is read once: its target through the one canonical-path decision (proxy/target.py), its kind
from the route table (proxy/routes.py). An inference request whose whole body is in and which the gate
admits at once goes to vLLM on a pooled connection (`FastExchange`, proxy/relays.py) as plain
callbacks; one the gate holds waits parked in the gate's queue as its parsed bytes (`HeldExchange`,
proxy/held.py), then goes the same way. Everything else (lifecycle and control calls, `/lifeguard/*`,
metrics, pass-through routes) is relayed unchanged to the aiohttp application through the seam
(`SeamExchange`, proxy/seam.py), so one keep-alive connection may mix both. Pipelined requests are
answered in order.

What the front refuses itself, in the one error format (handlers.render_error_bytes): what the request
reader refuses (proxy/request_reader.py: smuggling, oversized heads), then the connection is closed; for
inference, a declared or received body over `max_body_bytes` (413) and a body that stops arriving (408
after `client_body_timeout_s`), closed too; a target read two ways (400, the connection kept).
A connection without complete headers `client_idle_timeout_s` after it opened or after its last answer is
closed without a word, as aiohttp did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .config import Settings
from .coordinator import LifecycleCoordinator
from .errors import BadTarget, BodyTimeout, BodyTooLarge, LifeguardError
from .exchange import Exchange, Upstreams
from .gate import RequestGate
from .handlers import render_error_bytes
from .held import HeldExchange
from .relays import FastExchange, SeamExchange
from .request_reader import ParsedRequest, RequestReader
from .routes import RouteKind, RouteTable
from .target import canonical_target

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_S = 2.0
_DECIDED_CACHE_SIZE = 256
_NOT_PAUSED: frozenset[str] = frozenset()


class Front:
    """What every client connection of one proxy shares, and the connections themselves."""

    def __init__(
        self,
        settings: Settings,
        routes: RouteTable,
        gate: RequestGate,
        coordinator: LifecycleCoordinator,
        upstreams: Upstreams,
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.gate = gate
        self.coordinator = coordinator
        self.upstreams = upstreams
        self.connections: set[FrontConnection] = set()
        self.active = 0
        self._decided: dict[tuple[bytes, bytes], bytes] = {}
        self._drained: asyncio.Future[None] | None = None
        self.weights_stale: Callable[[], bool] = lambda: coordinator.weights_stale  # one for every held request

    def inference_target(self, method: bytes, url: bytes) -> bytes | BadTarget | None:
        """The origin-form target to send vLLM when (method, url) is an inference route, None when it is not,
        BadTarget when the target reads two ways. Inference uses a handful of targets: the decisions are kept
        (bounded, as query strings make targets unbounded)."""
        key = (method, url)
        decided = self._decided.get(key)
        if decided is not None:
            return decided or None
        try:
            target = canonical_target(url.decode("latin-1"))
        except BadTarget as exc:
            return exc
        kind = self.routes.classify(method.decode("latin-1"), target.path)
        fast = target.raw.encode("latin-1") if kind is RouteKind.INFERENCE else b""
        if len(self._decided) < _DECIDED_CACHE_SIZE:
            self._decided[key] = fast
        return fast or None

    def protocol(self) -> FrontConnection:
        return FrontConnection(self)

    def exchange_ended(self) -> None:
        self.active -= 1
        if self.active == 0 and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no exchange is in progress, at most `timeout_s`; then every client connection is closed."""
        drained = True
        if self.active:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._drained
            except TimeoutError:
                drained = False
        for conn in list(self.connections):
            if drained:
                conn.transport.close()
            else:
                conn.transport.abort()
        return drained


class FrontConnection(asyncio.Protocol):
    # Thousands stay open at once while requests are held (issue 21: < 2 KB each): slots, and nothing made per
    # connection before it is needed (docs/performance.md, "Held requests: where the bytes go").
    __slots__ = (
        "_front",
        "transport",
        "_reader",
        "_queue",
        "_active",
        "_idle_timer",
        "_idle_deadline",
        "_body_timer",
        "_refusal",
        "_read_pauses",
        "writing_paused",
        "_closing",
        "_close_after",
        "_pumping",
    )

    def __init__(self, front: Front) -> None:
        self._front = front
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self._reader = RequestReader(self._head_read)
        # Mostly empty or one request: a list (a deque takes a 64-slot block, ~600 B, at once).
        self._queue: list[ParsedRequest] = []
        self._active: Exchange | None = None
        # One timer per connection, re-armed only when it fires: a request in progress clears the deadline, an
        # answer moves it (no timer handle made and cancelled per request).
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_deadline: float | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refusal: LifeguardError | None = None
        self._read_pauses = _NOT_PAUSED  # rebuilt on a pause or resume, which are rare
        self.writing_paused = False
        self._closing = False
        self._close_after = False
        self._pumping = False

    # ----- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._front.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._closing or self._reader.upgraded:
            return
        refusal = self._reader.feed(data)
        if self._reader.upgraded:
            self._close_after = True
        if refusal is not None:
            self._refuse(refusal)
            return
        self._pump()

    def eof_received(self) -> bool | None:
        # A client's end of input is taken as the client leaving, as aiohttp's server does: a request it has
        # sent is abandoned (vLLM aborts it), whether the socket was half-closed or closed.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._cancel_timers()
        self._front.connections.discard(self)
        self._queue.clear()
        active, self._active = self._active, None
        if active is not None:
            active.client_gone()
            self._front.exchange_ended()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self._active is not None:
            self._active.client_writable(False)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._active is not None:
            self._active.client_writable(True)

    # ----- deciding
    def _head_read(self, request: ParsedRequest) -> None:
        self._idle_deadline = None
        self._classify(request)
        self._queue.append(request)
        if self._active is not None or len(self._queue) > 1:
            self._pause_reading("pipeline")  # answered in order: read on once the one before is answered

    def _classify(self, request: ParsedRequest) -> None:
        fast_target = self._front.inference_target(request.method, request.url)
        if isinstance(fast_target, BadTarget):
            request.error = fast_target
            return
        if fast_target is None:
            return
        request.fast_target = fast_target
        limit = self._front.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            # Refused before a byte is read; the body is still on the wire, so the connection cannot be reused.
            request.error = BodyTooLarge(
                f"the request body ({request.content_length} bytes) exceeds the limit of {limit} bytes",
                close_connection=True,
            )

    def _pump(self) -> None:
        if self._pumping:
            return
        self._pumping = True
        try:
            while not self._closing:
                active = self._active
                if active is not None:
                    if isinstance(active, SeamExchange):
                        active.send_body()
                    return
                if not self._queue or not self._start(self._queue[0]):
                    return
        finally:
            self._pumping = False

    def _start(self, request: ParsedRequest) -> bool:
        """Answer or start the request at the head of the queue; False while its body is still awaited."""
        front = self._front
        if request.error is not None:
            if not (request.complete or request.error.close_connection):
                self._await_body(request)
                return False
            self._queue.pop(0)
            self._answer(request, request.error)
            return True
        exchange: Exchange
        if request.fast_target is not None:
            limit = front.settings.max_body_bytes
            if request.body_size > limit:
                request.error = BodyTooLarge(
                    f"the request body exceeds the limit of {limit} bytes", close_connection=True
                )
                return self._start(request)
            if not request.complete:
                self._await_body(request)
                return False
            self._cancel_body_timer()
            ticket = front.gate.try_admit()
            if ticket is not None:
                exchange = FastExchange(
                    self,
                    request,
                    front.upstreams,
                    ticket,
                    request.fast_target,
                    stale=front.coordinator.weights_stale,
                )
            else:
                exchange = HeldExchange(
                    self,
                    request,
                    front.upstreams,
                    front.gate,
                    request.fast_target,
                    front.weights_stale,
                )
                # A held request's connection waits without llhttp's parser, and without the idle timer, which
                # would do nothing when it fired (a request is in progress); the answer arms it again.
                self._reader.rest()
                self._cancel_idle_timer()
        else:
            if request.expect_continue and not request.complete:
                self.transport.write(_CONTINUE)
            exchange = SeamExchange(self, request, front.upstreams)
        self._queue.pop(0)
        self._active = exchange
        front.active += 1
        exchange.start()
        return True

    def _await_body(self, request: ParsedRequest) -> None:
        if self._body_timer is None:
            if request.expect_continue:
                self.transport.write(_CONTINUE)
            timeout = self._front.settings.client_body_timeout_s
            self._body_timer = asyncio.get_running_loop().call_later(timeout, self._body_expired, timeout)

    def _body_expired(self, timeout: float) -> None:
        self._body_timer = None
        if self._closing or self._active is not None or not self._queue:
            return
        request = self._queue.pop(0)
        self._answer(request, request.error or BodyTimeout(f"the request body did not arrive within {timeout:g} s"))

    # ----- answering
    def _answer(self, request: ParsedRequest, error: LifeguardError) -> None:
        """An error of the front's own, for a request that reached no upstream."""
        self._cancel_body_timer()
        route_class = "inference" if request.fast_target is not None else "passthrough"  # as handlers.proxy counts
        self._front.upstreams.metrics.request_duration(route_class, time.monotonic() - request.started)
        close = error.close_connection or not request.keep_alive or not request.complete or self._close_after
        self.transport.write(render_error_bytes(error, close=close))
        if close:
            self._close()
        else:
            self._answered()

    def exchange_done(self, exchange: Exchange, *, close: bool) -> None:
        if self._active is not exchange:
            return
        self._active = None
        self._front.exchange_ended()
        if close or self._close_after or self._refusal is not None:
            if self._refusal is not None and not self._closing:
                self.transport.write(render_error_bytes(self._refusal, close=True))
            self._close()
            return
        self._answered()
        self._pump()

    def replace_exchange(self, old: Exchange, new: Exchange) -> None:
        """A held request admitted: its forwarding takes its place on this connection."""
        if self._active is old:
            self._active = new

    def _answered(self) -> None:
        # The next request (if one is queued) may still need its body read; one queued behind it pauses again.
        self._resume_reading("pipeline")
        if not self._queue:
            self._arm_idle()

    def _refuse(self, error: LifeguardError) -> None:
        """The request stream cannot be read on: answer `error` after the answer in progress, then close."""
        self._refusal = error
        self._queue.clear()
        self._cancel_body_timer()
        self._pause_reading("refused")
        active = self._active
        if active is None:
            self.transport.write(render_error_bytes(error, close=True))
            self._close()
        elif not active.request.complete:
            # Its body will never be whole: the upstream side sees a broken request, the client an answer
            # if none has begun.
            self._active = None
            self._front.exchange_ended()
            active.client_gone()
            if active.head_sent:
                self.transport.abort()
            else:
                self.transport.write(render_error_bytes(error, close=True))
            self._close()

    def upload_paused(self, paused: bool) -> None:
        if paused:
            self._pause_reading("upload")
        else:
            self._resume_reading("upload")

    # ----- connection upkeep
    def _close(self) -> None:
        """Close after what was written; what the client still sends is read and dropped for a moment, since
        closing a socket with unread bytes resets it and the client would lose the answer (a lingering close)."""
        if self._closing:
            return
        self._closing = True
        self._cancel_timers()
        if self.transport.is_closing():
            return
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._read_pauses = _NOT_PAUSED
        self.transport.resume_reading()
        self._idle_timer = asyncio.get_running_loop().call_later(_LINGER_S, self.transport.close)
        self._idle_deadline = None

    def _arm_idle(self) -> None:
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        self._idle_deadline = loop.time() + self._front.settings.client_idle_timeout_s
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(self._idle_deadline, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        deadline = self._idle_deadline
        if self._closing or deadline is None:
            return  # a request is in progress: its answer arms the deadline again
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._idle_timer = loop.call_at(deadline, self._idle_check)
        elif self._active is None and not self._queue:
            self._close()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_body_timer()
        self._cancel_idle_timer()

    def _pause_reading(self, reason: str) -> None:
        if not self._read_pauses and not self._closing:
            self.transport.pause_reading()
        self._read_pauses |= {reason}

    def _resume_reading(self, reason: str) -> None:
        if reason in self._read_pauses:
            self._read_pauses -= {reason}
            if not self._read_pauses and not self._closing:
                self.transport.resume_reading()


ProtocolFactory = Callable[[], FrontConnection]
