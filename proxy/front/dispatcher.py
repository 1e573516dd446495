"""The dispatcher: what every client connection of one proxy shares, and which exchange answers each request.

A request whose body is whole becomes one exchange: forwarded (exchange.py), held (held.py), forwarded once its
engine's lifecycle lock is free (answered.py) or answered by the proxy itself (own_answers.py). Which one is the
engine's question, asked through its door (`Engine`); the connection (connection.py) only reads and writes.
"""

from __future__ import annotations

import asyncio
import time

from ..errors import LifeguardError, ModelNotFound
from ..lifecycle.engine import Engine
from ..observe.metrics import INFERENCE_OUTCOMES
from ..upstream.refusals import Refusal
from .answered import Answered
from .connection import FrontConnection
from .engine_set import EngineSet
from .exchange import Exchange, Forward
from .held import HeldExchange, not_forwarded
from .own_answers import lifecycle, own
from .request_reader import ParsedRequest
from .route_table import RouteKind
from .routing import Route, model_of
from .serialized import SerializedForward


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
            return self.engine_exchange(client, request, route, route.engine)
        model = model_of(request.whole_body()) if route.by_model else None
        if model is None:
            raise self.router.not_chosen(route)
        name = engine_set.directory.known(model)
        if name is None:
            return Answered(client, request, self._discovered(client, request, route, model), tasks=engine_set.tasks,
                            count=engine_set.metrics.proxy_error)  # fmt: skip
        return self.engine_exchange(client, request, route, engine_set.engines[name])

    async def _discovered(self, client: FrontConnection, request: ParsedRequest, route: Route, model: str) -> Exchange:
        """A model no engine was known to serve: ask the engines once more (a LoRA adapter loaded since)."""
        name = await self.engine_set.directory.engine_for(model)
        if name is None:
            raise ModelNotFound(model)
        return self.engine_exchange(client, request, route, self.engine_set.engines[name])

    def after_refusal(
        self, client: FrontConnection, request: ParsedRequest, engine: Engine, refusal: Refusal
    ) -> Exchange:
        """The retry, in one place: a request vLLM refused for the engine's own state goes through the gate again
        (forwarded, held, or refused with the reason) once the engine has read and adopted that state."""
        request.reholds += 1

        async def again() -> Exchange:
            await engine.refused_by_vllm(refusal)
            assert request.route is not None
            return self.engine_exchange(client, request, request.route, engine)

        return Answered(client, request, again(), tasks=self.engine_set.tasks, count=engine.metrics.proxy_error)

    def engine_exchange(
        self, client: FrontConnection, request: ParsedRequest, route: Route, engine: Engine
    ) -> Exchange:
        """The exchange that answers `request` for `engine`, as the engine decides it."""
        kind = route.kind
        if kind is RouteKind.INFERENCE:
            ticket = engine.admit()
            if ticket is not None:
                return Forward(client, request, engine, route.target, ticket=ticket, stale=engine.weights_stale)
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
            plan = engine.plan_serialized(route.path, request.whole_body())
            return SerializedForward(client, request, engine, route.target, plan, drop=request.drop,
                                     tasks=self.engine_set.tasks)  # fmt: skip
        if kind is RouteKind.AT_ONCE:
            plan = engine.plan_at_once(route.path, route.target, request.whole_body())
            return Forward(client, request, engine, plan.target or route.target, drop=request.drop,
                           on_answer=plan.on_answer)  # fmt: skip
        if kind is RouteKind.NEVER_GATED:
            plan = engine.plan_read(route.path)
            return Forward(client, request, engine, route.target, drop=request.drop, rewrite=plan.rewrite)
        if kind is RouteKind.UNKNOWN:
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
