"""``create_sim_app``: the simulator as an aiohttp application.

A simulated process death (the ``crash`` fault, or the watchdog after ``lie-dead``) ends the real process
with ``os._exit(1)`` when ``crash_exits_process`` is set, as the CLI does. In-process (tests) the app
instead resets every open connection and keeps resetting new ones until ``engine.restart()``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from lifeguard_sim import (
    routes_checkpoint,
    routes_decisions,
    routes_fault_tolerance,
    routes_generate,
    routes_info,
    routes_lifecycle,
    routes_lora,
    routes_openai,
    trainer_servers,
    weight_checker,
)
from lifeguard_sim.engine import Engine
from lifeguard_sim.errors import ClientLeft, EngineGone, EngineHTTPError, EnginePaused, engine_paused_body
from lifeguard_sim.keys import LIVE_REQUESTS, SIM_ENGINE, LiveRequests, reset_connection
from lifeguard_sim.responses import json_response
from lifeguard_sim.settings import SimSettings

__all__ = ["SIM_ENGINE", "SimSettings", "create_sim_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _lifeline(request: web.Request, handler: Handler) -> web.StreamResponse:
    engine = request.app[SIM_ENGINE]
    live = request.app[LIVE_REQUESTS]
    if engine.scheduler.gone:
        reset_connection(request)
        return web.Response(status=500)
    live.add(request)
    try:
        return await handler(request)
    except EngineGone:
        # Nothing reaches the caller: its connection was reset.
        reset_connection(request)
        return web.Response(status=500)
    except ClientLeft:
        return web.Response(status=499)  # written to a closed connection: never read
    except EngineHTTPError as exc:
        return json_response(exc.body, status=exc.status)
    except EnginePaused:
        return json_response(engine_paused_body(), status=503)
    except web.HTTPNotFound:
        if request.path != "/" and request.path.endswith("/"):
            # starlette's redirect_slashes: a route spelt with a trailing slash is redirected, with an absolute
            # URL on vLLM's own address, to the route without it (307 keeps the method and the body).
            bare = request.path[:-1]
            match = await request.app.router.resolve(request.clone(rel_url=request.rel_url.with_path(bare)))
            if match.http_exception is None:
                location = request.url.with_path(bare).with_query(request.rel_url.query)
                return web.Response(status=307, headers={"Location": str(location)})
        return json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)
    finally:
        live.discard(request)


@web.middleware
async def _elastic_ep_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """vLLM's ScalingMiddleware (serve/elastic_ep/middleware.py): while scaling, or on a retired rank, every path it
    does not let through is answered 503 with a plain {"error": "<string>"}. The simulator's own /sim routes pass."""
    message = None if request.path.startswith("/sim/") else request.app[SIM_ENGINE].elastic_gate(request.path)
    if message is not None:
        return json_response({"error": message}, status=503)
    return await handler(request)


def _on_gone(settings: SimSettings, live: LiveRequests) -> Callable[[str], None]:
    def gone(reason: str) -> None:
        if settings.crash_exits_process:
            sys.stderr.write(f"vllm-lifeguard sim: {reason}; exiting\n")
            sys.stderr.flush()
            os._exit(1)
        live.reset_all()

    return gone


def create_sim_app(settings: SimSettings | None = None) -> web.Application:
    """Build the simulator app; the engine is ``app[SIM_ENGINE]``."""
    settings = settings or SimSettings()
    live = LiveRequests()
    engine = Engine(settings, on_gone=_on_gone(settings, live))
    app = web.Application(middlewares=[_lifeline, _elastic_ep_gate], client_max_size=64 * 1024 * 1024)
    app[SIM_ENGINE] = engine
    app[LIVE_REQUESTS] = live
    routes_openai.add_routes(app)
    if settings.dev_mode:  # VLLM_SERVER_DEV_MODE=1: serve/dev/ and rl/online/ routers
        routes_lifecycle.add_routes(app)
        weight_checker.add_routes(app)
    routes_info.add_routes(app)
    routes_generate.add_routes(app, settings.enable_scale_out)
    if engine.profile.decisions_route:
        routes_decisions.add_routes(app)
    if engine.profile.checkpoint and settings.sleep_mode:
        routes_checkpoint.add_routes(app)
    if settings.enable_fault_tolerance:
        routes_fault_tolerance.add_routes(app)
    if settings.enable_lora:
        routes_lora.add_routes(app)
    trainer_servers.add_routes(app, frozenset(settings.trainer_servers))

    async def start(_app: web.Application) -> None:
        engine.publish()

    async def stop(_app: web.Application) -> None:
        engine.shutdown()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app
