"""`create_app`: builds one proxy instance (no globals) and wires its parts together.

Shutdown order (aiohttp's runner): the listening socket closes, `on_shutdown` answers every held
request 503 `shutting_down` at once, in-flight requests and streams get the runner's grace period,
then the background loop stops and the upstream session closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from . import __version__
from .config import Settings
from .coordinator import LifecycleCoordinator
from .forward import Forwarder
from .gate import RequestGate
from .gpu import GpuMemoryReader, GpuReading, make_reader
from .handlers import (
    COORDINATOR,
    FORWARDER,
    GATE,
    INFLIGHT,
    METRICS,
    MOUNT,
    ROUTES,
    SETTINGS,
    UNKNOWN_ROUTES,
    error_middleware,
    healthz,
    proxy,
    readyz,
    serving,
    state,
)
from .inflight import InFlightRequests
from .metrics import Metrics
from .policies import Policies
from .probes import Verifier
from .reconcile import reconcile_loop
from .routes import LIFECYCLE_PATHS, build_table
from .states import TRANSITIONS, State
from .tasks import Tasks
from .unknown_routes import UnknownRoutes
from .upstream import VllmClient


def create_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    gpu: GpuMemoryReader | None = None,
    mount: str | None = None,
    on_engine: Callable[[LifecycleCoordinator, RequestGate], None] | None = None,
) -> web.Application:
    """The proxy as an aiohttp application; `settings.upstream` must be set. Several engines on one port
    (proxy/engines.py) mount one each at `mount`, and `on_engine` is told each one's coordinator and gate."""
    if settings.upstream is None or not settings.upstream.startswith(("http://", "https://")):
        raise ValueError("create_app needs settings.upstream as an http(s) URL (the CLI starts the simulator)")
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware])
    metrics = Metrics(
        registry if registry is not None else CollectorRegistry(),
        version=__version__,
        states=[s.value for s in State],
        operations=sorted(set(LIFECYCLE_PATHS.values())),
        edges=_edges(),
    )
    app[SETTINGS] = settings
    app[METRICS] = metrics
    if mount is not None:
        app[MOUNT] = mount
    app[ROUTES] = build_table(settings.routes.items(), unknown_routes=settings.unknown_routes)
    app[UNKNOWN_ROUTES] = UnknownRoutes(metrics)
    app.cleanup_ctx.append(
        _engine_context(settings, metrics, gpu or make_reader(settings.gpu_probe, settings.gpu_devices), on_engine)
    )
    app.on_shutdown.append(_on_shutdown)
    app.router.add_get("/lifeguard/state", state)
    app.router.add_get("/lifeguard/healthz", healthz)
    app.router.add_get("/lifeguard/readyz", readyz)
    app.router.add_get("/lifeguard/serving", serving)
    app.router.add_get("/lifeguard/metrics", metrics.handler())
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def _edges() -> list[tuple[str, str]]:
    edges = set()
    for t in TRANSITIONS:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for src in sources:
            if src is not t["dest"]:
                edges.add((src.value, t["dest"].value))
    return sorted(edges)


def _engine_context(
    settings: Settings,
    metrics: Metrics,
    gpu: GpuMemoryReader,
    on_engine: Callable[[LifecycleCoordinator, RequestGate], None] | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        assert settings.upstream is not None
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=settings.upstream_max_connections, keepalive_timeout=settings.upstream_keepalive_s
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
            auto_decompress=False,
        )
        client = VllmClient(session, settings.upstream, control_timeout_s=settings.control_call_timeout_s)
        verifier = Verifier(
            client,
            gpu,
            settings,
            on_check=metrics.verification,
            on_memory=lambda reading: _report_memory(metrics, reading),
        )
        gate = RequestGate(
            max_held=settings.max_held_requests,
            max_held_bytes=settings.max_held_bytes,
            hold_timeout_s=settings.hold_timeout_s,
            on_hold_ended=metrics.hold_finished,
        )
        metrics.watch_counts(lambda: gate.held, lambda: gate.inflight)
        tasks = Tasks()
        inflight = InFlightRequests()
        coordinator = LifecycleCoordinator(settings, client, verifier, gate, metrics, tasks, inflight)
        policies = Policies(settings, coordinator, gate, metrics)
        gate.on_held_while_sleeping = policies.request_held_while_sleeping
        if on_engine is not None:
            on_engine(coordinator, gate)
        app[GATE] = gate
        app[INFLIGHT] = inflight
        app[COORDINATOR] = coordinator
        app[FORWARDER] = Forwarder(session, settings.upstream, on_latency=metrics.upstream_latency)
        stop = asyncio.Event()
        loop_task = tasks.spawn(
            reconcile_loop(coordinator, policies, settings.reconcile_interval_s, stop), name="reconcile"
        )
        yield
        stop.set()
        await loop_task
        await tasks.close()  # a lifecycle call or policy action still running ends here, not after the loop
        await session.close()

    return context


def _report_memory(metrics: Metrics, reading: GpuReading) -> None:
    metrics.gpu_probe_available(reading.available)
    for device in reading.devices:
        metrics.gpu_memory(device.gpu, device.used_bytes, device.total_bytes)


async def _on_shutdown(app: web.Application) -> None:
    app[COORDINATOR].close()
