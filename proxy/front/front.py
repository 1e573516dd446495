"""The front: the proxy's one listening socket, served by an `asyncio.Protocol` with llhttp (httptools).

Each request is read once; its head decides where it goes (routing.py); once its whole body is in it becomes one
exchange (exchange.py): forwarded, held (held.py) or answered by the proxy (answers.py). One keep-alive
connection may mix them all; pipelined requests are answered in order. What the front refuses itself (smuggling,
oversized heads and bodies, slow bodies, ambiguous targets, unknown engines, a missing token) is answered in the one
error format (wire.py). Every callback catches what it did not expect (boundary.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

from ..engine import Engine
from ..errors import BodyTimeout, BodyTooLarge, LifeguardError, ModelNotFound
from ..lifecycle.prefix_cache import LORA_LOAD_PATH, RESET_PATH, reloaded_adapter
from ..lifecycle.rules import control_refusal
from ..lifecycle.weight_checksums import resets_weights
from ..lifecycle.weight_version import RELABEL_PATH
from ..observe.metrics import INFERENCE_OUTCOMES
from ..upstream.refusals import Refusal
from .admin import admin_carrier
from .answered import Answered, SerializedForward
from .answers import lifecycle, own
from .boundary import caught
from .engine_set import EngineSet
from .exchange import Exchange, Forward
from .held import HeldExchange, not_forwarded
from .request_reader import ParsedRequest, RequestReader
from .route_table import RouteKind
from .routing import GUARDED, Route, model_of
from .wire import error_bytes

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_S = 2.0
_NOT_PAUSED: frozenset[str] = frozenset()


class Front:
    """What every client connection of one proxy shares, and the connections themselves."""

    def __init__(self, engine_set: EngineSet) -> None:
        self.engine_set = engine_set
        self.settings = engine_set.settings
        self.router = engine_set.router
        token = engine_set.settings.admin_token
        self.admin_token = token.get_secret_value().encode() if token is not None else None
        self.connections: set[FrontConnection] = set()
        self.active = 0
        self._drained: asyncio.Future[None] | None = None

    def protocol(self) -> FrontConnection:
        return FrontConnection(self)

    def exchange_for(self, client: FrontConnection, request: ParsedRequest) -> Exchange:
        """The exchange that answers `request` (its body whole); raises the LifeguardError to answer instead."""
        route = request.route
        assert route is not None
        engine_set = self.engine_set
        if route.kind is None:
            return Answered(client, request, own(engine_set, route, request), tasks=engine_set.tasks,
                            count=engine_set.metrics.proxy_error)  # fmt: skip
        if route.engine is not None:
            return self.for_engine(client, request, route, route.engine)
        model = model_of(request.whole_body()) if route.by_model else None
        if model is None:
            raise self.router.not_chosen(route)
        name = engine_set.directory.known(model)
        if name is None:
            return Answered(client, request, self._discovered(client, request, route, model), tasks=engine_set.tasks,
                            count=engine_set.metrics.proxy_error)  # fmt: skip
        return self.for_engine(client, request, route, engine_set.engines[name])

    async def _discovered(self, client: FrontConnection, request: ParsedRequest, route: Route, model: str) -> Exchange:
        """A model no engine was known to serve: ask the engines once more (a LoRA adapter loaded since)."""
        name = await self.engine_set.directory.engine_for(model)
        if name is None:
            raise ModelNotFound(model)
        return self.for_engine(client, request, route, self.engine_set.engines[name])

    async def after_refusal(
        self, client: FrontConnection, request: ParsedRequest, engine: Engine, refusal: Refusal
    ) -> Exchange:
        """A request vLLM refused for the engine's own state, once the coordinator has read and adopted that
        state: through the gate again (forwarded, held, or refused with the reason)."""
        await engine.coordinator.engine_refused(refusal)
        assert request.route is not None
        return self.for_engine(client, request, request.route, engine)

    def for_engine(self, client: FrontConnection, request: ParsedRequest, route: Route, engine: Engine) -> Exchange:
        kind = route.kind
        if kind is RouteKind.INFERENCE:
            ticket = engine.gate.try_admit()
            if ticket is not None:
                return Forward(client, request, engine, route.target, ticket=ticket,
                               stale=engine.coordinator.weights_stale)  # fmt: skip
            return HeldExchange(client, request, engine, route.target)
        if route.op is not None:
            metrics = engine.metrics
            return Answered(
                client,
                request,
                lifecycle(engine, route.op, route.query, request.whole_body()),
                tasks=self.engine_set.tasks,
                count=metrics.proxy_error,
                on_end=lambda seconds: metrics.request_duration("lifecycle", seconds),
            )
        if kind is RouteKind.SERIALIZED:
            adapter = reloaded_adapter(request.whole_body()) if route.path == LORA_LOAD_PATH else None
            on_answer = engine.coordinator.adapter_reload_answered(adapter) if adapter is not None else None
            zeroes = resets_weights(route.path, request.whole_body())
            tasks = self.engine_set.tasks
            return SerializedForward(client, request, engine, route.target, drop=request.drop, tasks=tasks,
                                     on_answer=on_answer, zeroes_weights=zeroes)  # fmt: skip
        if kind is RouteKind.AT_ONCE:
            if (refusal := control_refusal(engine.coordinator.record.view())) is not None:
                raise refusal
            if route.path == RESET_PATH:
                return Forward(client, request, engine, route.target, drop=request.drop,
                               on_answer=engine.coordinator.client_reset_answered)  # fmt: skip
            if route.path == RELABEL_PATH:
                relabel = engine.coordinator.versions.relabel_answered(request.whole_body())
                return Forward(client, request, engine, route.target, drop=request.drop, on_answer=relabel)
        elif kind is RouteKind.UNKNOWN:
            engine.unknown_routes.seen(request.method.decode("latin-1"), route.path)
        return Forward(client, request, engine, route.target, drop=request.drop)

    def refused_at_the_door(self, request: ParsedRequest, error: LifeguardError) -> None:
        """Count a request the front answered with `error` before any exchange, where its engine is known."""
        route = request.route
        engine = route.engine if route is not None else None
        if engine is None:
            return
        if route is not None and route.kind is RouteKind.INFERENCE:
            outcome = error.reason if error.reason in INFERENCE_OUTCOMES else "engine_unavailable"
            not_forwarded(engine, request, outcome)
            return
        if route is not None and route.op is not None:
            outcome = "invalid" if error.status in (400, 413) else "unauthorized"
            engine.metrics.operation_finished(route.op, outcome, 0)
        engine.metrics.request_duration("passthrough", time.monotonic() - request.started)

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
        # uvloop's transports are not subclasses of asyncio.Transport; they have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self._front.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._closing or self._reader.upgraded:
            return
        try:
            refusal = self._reader.feed(data)
            if self._reader.upgraded:
                self._close_after = True
            if refusal is not None:
                self._refuse(refusal)
                return
            self._pump()
        except Exception as exc:
            self._crashed(exc)

    def eof_received(self) -> bool | None:
        # A client's end of input is taken as the client leaving, as aiohttp's server does: a request it has
        # sent is abandoned (vLLM aborts it), whether the socket was half-closed or closed.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._cancel_timers()
        self._front.connections.discard(self)
        self._drop_active()

    def pause_writing(self) -> None:
        self.writing_paused = True
        self._tell_writable(False)

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._tell_writable(True)

    def _tell_writable(self, writable: bool) -> None:
        if self._active is not None:
            try:
                self._active.client_writable(writable)
            except Exception as exc:
                self._crashed(exc)

    def _crashed(self, exc: Exception) -> None:
        """A bug of ours while serving this connection (proxy/front/boundary.py): whatever was in progress is ended,
        the client is answered (or, mid-answer, its connection dropped), and the connection closes."""
        error = caught("client", exc, self._front.engine_set.metrics.proxy_error)
        active = self._drop_active()
        if active is not None and active.head_sent:
            self.transport.abort()
            self._closing = True
            return
        if not self._closing and not self.transport.is_closing():
            self.transport.write(error_bytes(error, close=True))
        self._close()

    def _drop_active(self) -> Exchange | None:
        """Forget what is queued and end what is in progress as if its client had left; returns what was."""
        self._queue.clear()
        active, self._active = self._active, None
        if active is not None:
            self._front.exchange_ended()
            try:
                active.client_gone()
            except Exception as bug:
                caught("client", bug, self._front.engine_set.metrics.proxy_error)
        return active

    # ----- deciding
    def _head_read(self, request: ParsedRequest) -> None:
        self._idle_deadline = None
        self._route(request)
        self._queue.append(request)
        if self._active is not None or len(self._queue) > 1:
            self._pause_reading("pipeline")  # answered in order: read on once the one before is answered

    def _route(self, request: ParsedRequest) -> None:
        """Where it goes, and what is refused before a byte of its body is read (nothing is buffered for a
        caller without the admin token, nor beyond the size limit): refused with its body still on the wire,
        the connection cannot carry another request."""
        front = self._front
        try:
            route = request.route = front.router.route(request.method, request.url)
            if route.kind in GUARDED:
                request.drop = admin_carrier(request.headers, front.admin_token)
        except LifeguardError as exc:
            if request.content_length or request.chunked:
                exc.close_connection = exc.close_connection or exc.status in (401, 403)
            request.error = exc
            return
        if request.content_length is not None and (limit := self._exceeded(request, request.content_length)):
            request.error = BodyTooLarge(
                f"the request body ({request.content_length} bytes) exceeds the limit of {limit} bytes",
                close_connection=True,
            )

    def _exceeded(self, request: ParsedRequest, size: int) -> int:
        """The body limit `size` bytes of `request` exceed, else 0. Every route's limit is at least max_body_bytes,
        so a body within it is not looked at again (the common case, once per request)."""
        settings = self._front.settings
        if size <= settings.max_body_bytes:
            return 0
        limit = settings.body_limit(request.route.op if request.route is not None else None)
        return limit if size > limit else 0

    def _pump(self) -> None:
        if self._pumping:
            return
        self._pumping = True
        try:
            while not self._closing and self._active is None and self._queue and self._start(self._queue[0]):
                pass
        finally:
            self._pumping = False

    def _start(self, request: ParsedRequest) -> bool:
        """Answer or start the request at the head of the queue; False while its body is still awaited."""
        front = self._front
        if request.error is None and (limit := self._exceeded(request, request.body_size)):
            request.error = BodyTooLarge(f"the request body exceeds the limit of {limit} bytes", close_connection=True)
        if not (request.complete or (request.error is not None and request.error.close_connection)):
            self._await_body(request)
            return False
        self._cancel_body_timer()
        self._queue.pop(0)
        if request.error is not None:
            self._answer(request, request.error)
            return True
        try:
            exchange = front.exchange_for(self, request)
        except LifeguardError as exc:
            self._answer(request, exc)
            return True
        if isinstance(exchange, HeldExchange):
            # A held request's connection waits without llhttp's parser, and without the idle timer, which
            # would do nothing when it fired (a request is in progress); the answer arms it again.
            self._reader.rest()
            self._cancel_idle_timer()
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
        try:
            request = self._queue.pop(0)
            self._answer(request, request.error or BodyTimeout(f"the request body did not arrive within {timeout:g} s"))
        except Exception as exc:
            self._crashed(exc)

    # ----- answering
    def _answer(self, request: ParsedRequest, error: LifeguardError) -> None:
        """An error of the front's own, for a request that reached no exchange."""
        self._cancel_body_timer()
        self._front.refused_at_the_door(request, error)
        close = error.close_connection or not request.keep_alive or not request.complete or self._close_after
        self.transport.write(error_bytes(error, close=close))
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
                self.transport.write(error_bytes(self._refusal, close=True))
            self._close()
            return
        self._answered()
        if self._queue:
            self._pump()

    def replace_exchange(self, old: Exchange, new: Exchange) -> None:
        """An exchange hands over to another (a held request admitted, a control call let through)."""
        if self._active is old:
            self._active = new

    def back_to_the_gate(self, old: Exchange, engine: Engine, refusal: Refusal) -> None:
        request = old.request
        request.reholds += 1
        engine_set = self._front.engine_set
        again = Answered(self, request, self._front.after_refusal(self, request, engine, refusal),
                         tasks=engine_set.tasks, count=engine.metrics.proxy_error)  # fmt: skip
        self.replace_exchange(old, again)
        again.start()

    def _answered(self) -> None:
        # The next request (if one is queued) may still need its body read; one queued behind it pauses again.
        if self._read_pauses:
            self._resume_reading("pipeline")
        if not self._queue:
            self._arm_idle()

    def _refuse(self, error: LifeguardError) -> None:
        """The request stream cannot be read on: answer `error` after the answer in progress, then close."""
        self._refusal = error
        self._queue.clear()
        self._cancel_body_timer()
        self._pause_reading("refused")
        if self._active is None:
            self.transport.write(error_bytes(error, close=True))
            self._close()

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
        # The loop's clock (asyncio's and uvloop's), read without looking the loop up: once per answer.
        self._idle_deadline = time.monotonic() + self._front.settings.client_idle_timeout_s
        if self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_at(self._idle_deadline, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        deadline = self._idle_deadline
        if self._closing or deadline is None:
            return  # a request is in progress: its answer arms the deadline again
        if time.monotonic() < deadline:
            self._idle_timer = asyncio.get_running_loop().call_at(deadline, self._idle_check)
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
