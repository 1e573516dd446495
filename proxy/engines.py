"""`create_engines_app`: several engines sharing GPUs behind one port (`engines:`, docs/model-swap.md).

Each engine is today's single-engine proxy (`create_app`: its own coordinator, gate, verifier, record and
forwarder) mounted at `/engines/<name>/`, so a trainer changes one base URL per engine. Every lifecycle call
of an engine passes the one `Arbiter` (proxy/arbiter.py) first. At the top level:

* inference is routed by the `"model"` of its JSON body to the engine serving that name (proxy/model_directory.py);
  a name no engine serves is answered as vLLM answers it (404 `NotFoundError`, `param: "model"`);
* `GET /v1/models` lists every engine's models;
* any other route (a lifecycle call above all) must name its engine: 400 `engine_not_chosen`, naming the
  choices; with a single engine configured, it goes to that one;
* `/lifeguard/state` shows every engine, per GPU the engines awake and free memory, footprints and the swap
  queue; `/lifeguard/metrics` has every engine's series with an `engine` label, plus the swap series.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from functools import partial

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .app import create_app
from .arbiter import Arbiter
from .config import Settings
from .errors import EngineNotChosen, ModelNotFound, NotServing, UnknownEngine
from .gpu import GpuMemoryReader, make_engine_reader, make_reader
from .handlers import COORDINATOR, GATE, METRICS, ROUTES, SETTINGS, error_middleware, read_body, serve_target
from .metrics import SwapMetrics
from .model_directory import ModelDirectory
from .routes import RouteKind, build_table
from .serving import engine_refusal, fleet_answer
from .states import State
from .target import Target, below_mount, canonical_target
from .upstream import VllmClient

ENGINE_APPS = web.AppKey("engine_apps", dict[str, web.Application])
ARBITER = web.AppKey("arbiter", Arbiter)
MODELS = web.AppKey("models", ModelDirectory)
_CLIENTS = web.AppKey("directory_clients", dict[str, VllmClient])
ENGINES_PREFIX = "/engines"


def create_engines_app(settings: Settings, *, gpu: GpuMemoryReader | None = None) -> web.Application:
    """The top-level application of several engines; `settings.engines` must not be empty."""
    if not settings.engines:
        raise ValueError("create_engines_app needs settings.engines")
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware])
    registry = CollectorRegistry()
    arbiter = Arbiter(
        settings,
        gpu or make_reader(settings.gpu_probe, settings.gpu_devices),
        SwapMetrics(registry, [engine.name for engine in settings.engines]),
    )
    apps: dict[str, web.Application] = {}
    # A mount claims its bare path (no trailing slash) and has no route for it: answered as the engine's `/`.
    app.middlewares.append(_bare_mount(apps))
    for engine in settings.engines:
        mount = f"{ENGINES_PREFIX}/{engine.name}"
        apps[engine.name] = create_app(
            settings.for_engine(engine),
            gpu=make_engine_reader(settings.gpu_probe, engine.name),
            mount=mount,
            on_engine=partial(arbiter.attach, engine.name),
        )
        app.add_subapp(mount, apps[engine.name])
    registry.register(_EveryEngine(apps))
    app[SETTINGS] = settings
    app[ENGINE_APPS] = apps
    app[ARBITER] = arbiter
    app[ROUTES] = build_table(settings.routes.items(), unknown_routes=settings.unknown_routes)
    clients: dict[str, VllmClient] = {}
    app[_CLIENTS] = clients
    app[MODELS] = ModelDirectory(settings, clients)
    app.cleanup_ctx.append(partial(_directory_session, settings))
    app.router.add_get("/lifeguard/state", _state)
    app.router.add_get("/lifeguard/healthz", _healthz)
    app.router.add_get("/lifeguard/readyz", _readyz)
    app.router.add_get("/lifeguard/serving", _serving)
    app.router.add_get("/lifeguard/metrics", make_aiohttp_handler(registry))
    app.router.add_get("/v1/models", _models)
    app.router.add_route("*", "/{tail:.*}", _dispatch)
    return app


async def _directory_session(settings: Settings, app: web.Application) -> AsyncIterator[None]:
    """The top level's own connection to the engines: model discovery only."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    ) as session:
        for engine in settings.engines:
            app[_CLIENTS][engine.name] = VllmClient(
                session, engine.upstream, control_timeout_s=settings.control_call_timeout_s
            )
        yield


async def _dispatch(request: web.Request) -> web.StreamResponse:
    """Every top-level path that is not ours: to the engine its model names, or to the only engine."""
    app = request.app
    target = canonical_target(request.raw_path)
    engines = app[ENGINE_APPS]
    if target.path == ENGINES_PREFIX or target.path.startswith(ENGINES_PREFIX + "/"):
        name = target.path[len(ENGINES_PREFIX) + 1 :].split("/", 1)[0]
        raise UnknownEngine(f"no engine is named {name!r} here; the engines are: {', '.join(engines)}")
    if len(engines) == 1:
        return await serve_target(request, next(iter(engines.values())), target)
    kind = app[ROUTES].classify(request.method, target.path)
    if kind in (RouteKind.INFERENCE, RouteKind.NEVER_GATED):
        model = _model_of(await read_body(request, app[SETTINGS]))
        if model is not None:
            serving = await app[MODELS].engine_for(model)
            if serving is None:
                raise ModelNotFound(model)
            return await serve_target(request, engines[serving], target)
    raise EngineNotChosen(_choose(target, engines, lifecycle=kind is RouteKind.LIFECYCLE))


def _bare_mount(apps: dict[str, web.Application]) -> Middleware:
    """`/engines/<name>` without a trailing slash: that engine's `/`, not aiohttp's plain-text 404."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            target = canonical_target(request.raw_path)
            name = target.path[len(ENGINES_PREFIX) + 1 :]
            if not target.path.startswith(ENGINES_PREFIX + "/") or name not in apps:
                raise
            return await serve_target(request, apps[name], below_mount(target, f"{ENGINES_PREFIX}/{name}"))

    return middleware


def _choose(target: Target, engines: Iterable[str], *, lifecycle: bool) -> str:
    where = ", ".join(f"{ENGINES_PREFIX}/{name}{target.path}" for name in engines)
    if lifecycle:
        return f"several engines are guarded here: send {target.path} to one of them: {where}"
    return f"several engines are guarded here and this request names no served model: send it to one of {where}"


def _model_of(body: bytes) -> str | None:
    if not body:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) and model else None


async def _models(request: web.Request) -> web.Response:
    return web.json_response(await request.app[MODELS].listing())


async def _state(request: web.Request) -> web.Response:
    app = request.app
    arbiter = await app[ARBITER].snapshot()
    models = app[MODELS].names()
    engines = {}
    for engine in app[SETTINGS].engines:
        engine_app = app[ENGINE_APPS][engine.name]
        engines[engine.name] = {
            **engine_app[COORDINATOR].snapshot(),
            "gpus": list(engine.gpus),
            "pinned": engine.pinned,
            "swap_sleep_level": engine.swap_sleep_level,
            "models": models[engine.name],
            "footprint_bytes": arbiter["footprint_bytes"][engine.name],
            "base_url": f"{ENGINES_PREFIX}/{engine.name}/",
        }
    return web.json_response({"engines": engines, **arbiter})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready while any engine can serve or hold: one engine down must not take the others out of the Service."""
    states = {}
    for name, engine_app in request.app[ENGINE_APPS].items():
        current = engine_app[COORDINATOR].state
        states[name] = current.value if not engine_app[GATE].closed else "closed"
    ready = any(value not in (State.FAILED.value, State.STARTING.value, "closed") for value in states.values())
    return web.json_response({"ready": ready, "engines": states}, status=200 if ready else 503)


async def _serving(request: web.Request) -> web.Response:
    """Serving while any engine serves (proxy/serving.py); each engine's own is at /engines/<name>/lifeguard/serving."""
    answer = fleet_answer(
        {name: engine_refusal(a[COORDINATOR], a[GATE], a[SETTINGS]) for name, a in request.app[ENGINE_APPS].items()}
    )
    if isinstance(answer, NotServing):
        raise answer
    return web.json_response(answer)


class _EveryEngine(Collector):
    """Every engine's own series, merged family by family, with an `engine` label."""

    def __init__(self, apps: dict[str, web.Application]) -> None:
        self._apps = apps

    def describe(self) -> list[Metric]:
        return []  # the families are each engine's: nothing to check for clashes at registration

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for name, engine_app in self._apps.items():
            for family in engine_app[METRICS].registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    out.add_sample(
                        sample.name, {**sample.labels, "engine": name}, sample.value, sample.timestamp, sample.exemplar
                    )
        return list(merged.values())
