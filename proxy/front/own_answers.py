"""What the proxy answers itself: lifecycle calls (through the engine's coordinator) and its own routes.

`/lifeguard/state`, `healthz`, `readyz`, `serving`, `metrics` and the status page, at the top level about every
engine and under `/engines/<name>/` about that one; with several engines, `GET /v1/models` lists every engine's
models. Nothing here knows HTTP framing: each answer is a `wire.Answer`. The routes: docs/reference/routes.md.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from ..compiled import build
from ..errors import MethodNotAllowed, NotFound, NotServing
from ..lifecycle.engine import Engine
from ..lifecycle.outcome import Outcome
from ..lifecycle.states import State
from . import status_page
from .admin import check_reader, token_bytes
from .engine_set import EngineSet
from .readiness import SERVING, engines_answer
from .request_reader import ParsedRequest
from .routing import Route
from .wire import Answer, json_answer

OwnRoute = Callable[[EngineSet, Engine | None, ParsedRequest], Awaitable[Answer]]


async def lifecycle(engine: Engine, op: str, query: str, body: bytes) -> Answer:
    """A lifecycle call, run by `engine`'s coordinator: vLLM's reply (or ours) with what was decided."""
    return outcome_answer(await engine.run_call(op, parse_qsl(query, keep_blank_values=True), body))


def outcome_answer(outcome: Outcome) -> Answer:
    """vLLM's reply (or ours), with what the coordinator decided as `X-Lifeguard-*` headers."""
    headers: list[tuple[bytes, bytes]] = []
    if outcome.verdict is not None:
        headers.append((b"X-Lifeguard-Verified", outcome.verdict.summary().encode()))
    if outcome.noop:
        headers.append((b"X-Lifeguard-Noop", b"true"))
    if outcome.deferred:
        headers.append((b"X-Lifeguard-Deferred", b"pause applied on wake"))
    if outcome.drained is not None:
        headers.append((b"X-Lifeguard-Drained", outcome.drained.encode()))
    if outcome.pause_kept is not None:
        headers.append((b"X-Lifeguard-Pause-Kept", outcome.pause_kept.encode()))
    content_type = outcome.content_type.encode("latin-1") if outcome.content_type else None
    return Answer(outcome.status, outcome.body, content_type, tuple(headers))


async def own(engine_set: EngineSet, route: Route, request: ParsedRequest) -> Answer:
    """One of the proxy's own routes."""
    if route.path == status_page.PAGE_PATH:
        return _status_page(engine_set, route, request)
    handler = _OWN.get(route.path) if route.path != "/v1/models" else _models
    if handler is None:
        raise NotFound(f"the proxy serves no {route.path}; its own routes are: {', '.join(_OWN)}")
    if request.method not in (b"GET", b"HEAD"):
        raise MethodNotAllowed(f"{route.path} answers GET only")
    return await handler(engine_set, route.engine, request)


def _status_page(engine_set: EngineSet, route: Route, request: ParsedRequest) -> Answer:
    """The status page: the engines' states, timeline, GPU memory, swap queue and recent errors, read from
    `/lifeguard/state` every second; with `admin_token` set, a sign-in form (its POST sets a session cookie)."""
    # `path` as the browser sees it, for the cookie's Path.
    token = token_bytes(engine_set.settings.admin_token)
    path = (f"/engines/{route.engine.name}" if route.engine is not None else "") + route.path
    if request.method in (b"GET", b"HEAD"):
        return status_page.page_answer(request.headers, token, path, time.time())
    if request.method == b"POST":
        return status_page.sign_in_answer(request.headers, request.whole_body(), token, path, time.time())
    raise MethodNotAllowed(f"{route.path} answers GET, and POST from its sign-in form")


async def _state(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """The engines' state as JSON: each engine's snapshot (state, sleep, pause, weights, verification, errors) and
    models; with several engines or `gpu_lock_dir`, the GPUs, footprints, swap queue and node locks; the build that
    runs (`compiled` or `pure`, proxy/compiled.py). Needs the admin token when one is set (or a status page session)."""
    check_reader(request.headers, token_bytes(engine_set.settings.admin_token), time.time())
    models = engine_set.directory.names()
    if engine is not None:
        return json_answer({**engine.snapshot(), "models": models[engine.name], "build": build()})
    engines = {name: {**one.snapshot(), "models": models[name]} for name, one in engine_set.engines.items()}
    state: dict[str, Any] = {"engines": engines, "build": build()}
    if engine_set.arbiter is not None:
        state.update(await engine_set.arbiter.snapshot())
    if len(engines) == 1:
        state = {**next(iter(engines.values())), **state}
    return json_answer(state)


async def _healthz(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """Liveness of the proxy alone: `{"status": "ok"}` whenever it answers, whatever the engines do (a sleeping or
    failed engine must not restart the pod)."""
    return json_answer({"status": "ok"})


async def _readyz(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """Ready while an engine can serve or hold: a sleeping engine keeps the pod ready; a failed, never-started
    or shutting-down one does not. At the top level, any engine: one down must not take the others out of
    the Service."""
    engines = [engine] if engine is not None else list(engine_set.engines.values())
    states = {one.name: one.state_name for one in engines}
    ready = any(value not in (State.FAILED.value, State.STARTING.value, "closed") for value in states.values())
    body: dict[str, Any] = {"ready": ready, "engines": states}
    if len(engines) == 1:
        view = engines[0].view()
        body["state"] = view.state.value
        if not ready and view.reason is not None:  # FAILED's cause, or vLLM not reached yet: as the log says it
            body["reason"] = view.reason
    return json_answer(body, 200 if ready else 503)


async def _serving(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """200 while an inference request sent now would be forwarded at once (proxy/front/readiness.py); at the top level,
    while any engine's would."""
    engines = [engine] if engine is not None else list(engine_set.engines.values())
    refusals = {one.name: one.serving_refusal() for one in engines}
    if len(engines) == 1:
        refusal = refusals[engines[0].name]
        if refusal is not None:
            raise refusal
        return json_answer(SERVING)
    answer = engines_answer(refusals)
    if isinstance(answer, NotServing):
        raise answer
    return json_answer(answer)


async def _metrics(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """The proxy's own `lifeguard_*` series (Prometheus text or OpenMetrics, as the scraper asks), every engine's
    with an `engine` label (docs/reference/metrics.md). vLLM's own are at `/metrics`, passed through."""
    accept = next((value for name, value in request.headers if name.lower() == b"accept"), b"")
    body, content_type = engine_set.metrics.exposition(accept.decode("latin-1"))
    return Answer(200, body, content_type.encode("latin-1"))


async def _models(engine_set: EngineSet, engine: Engine | None, request: ParsedRequest) -> Answer:
    """With several engines, `GET /v1/models` at the top level: every engine's models in one list."""
    return json_answer(await engine_set.directory.listing())


_OWN: dict[str, OwnRoute] = {
    "/lifeguard/state": _state,
    "/lifeguard/healthz": _healthz,
    "/lifeguard/readyz": _readyz,
    "/lifeguard/serving": _serving,
    "/lifeguard/metrics": _metrics,
}
