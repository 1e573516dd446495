"""`Engine`: one guarded vLLM, the unit the proxy is made of.

A single `upstream:` is one engine (named `default`); `engines:` is several, each guarded the same way.
An engine has its own coordinator (and with it its record, verifier and rules), request gate, in-flight
requests, policies, reconcile loop, GPU footprint and pool of connections to its vLLM. It knows nothing of
the others: several engines meet only in the arbiter (proxy/sharing/arbiter.py) and the front
(proxy/front/connection.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from ..config import EngineSettings, Settings
from ..gpu.footprint import Footprint
from ..gpu.readers import GpuMemoryReader, GpuReading
from ..observe.metrics import EngineMetrics
from ..observe.unknown_routes import UnknownRoutes
from ..tasks import Tasks
from ..upstream.forwarding import Upstream
from ..upstream.vllm_client import VllmClient
from .coordinator import LifecycleCoordinator
from .gate import RequestGate
from .inflight import InFlightRequests
from .policies import Policies
from .reconcile import reconcile_loop
from .verifier import Verifier


class Engine:
    def __init__(
        self,
        settings: Settings,
        config: EngineSettings,
        *,
        metrics: EngineMetrics,
        gpu: GpuMemoryReader,
        session: aiohttp.ClientSession,
    ) -> None:
        """`settings`: the proxy's, as `Settings.for_engine(config)` made them for this engine."""
        self.name = config.name
        self.config = config
        self.settings = settings
        self.metrics = metrics
        self.footprint = Footprint(config.footprint_gib)
        self.client = VllmClient(session, config.upstream, control_timeout_s=settings.control_call_timeout_s)
        self.verifier = Verifier(
            self.client,
            gpu,
            settings,
            footprint=self.footprint,
            on_check=metrics.verification,
            on_memory=self._report_memory,
        )
        self.gate = RequestGate(
            max_held=settings.max_held_requests,
            max_held_bytes=settings.max_held_bytes,
            hold_timeout_s=settings.hold_timeout_s,
            on_hold_ended=metrics.hold_finished,
        )
        metrics.watch_counts(lambda: self.gate.held, lambda: self.gate.inflight)
        self.tasks = Tasks()
        self.inflight = InFlightRequests()
        self.coordinator = LifecycleCoordinator(settings, self.client, self.verifier, self.gate, metrics, self.tasks,
                                                self.inflight)  # fmt: skip
        self.policies = Policies(settings, self.coordinator, self.gate, metrics)
        self.gate.on_held_while_sleeping = self.policies.request_held_while_sleeping
        self.unknown_routes = UnknownRoutes(metrics)
        self.upstream = Upstream(
            config.upstream,
            shown=settings.upstream_shown,
            max_connections=settings.upstream_max_connections,
            max_connecting=settings.upstream_max_connecting,
            keepalive_s=settings.upstream_keepalive_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
        self._stop = asyncio.Event()

    def start(self) -> None:
        """Start the reconcile loop (it finds out what the engine is, then keeps watching)."""
        self.tasks.spawn(
            reconcile_loop(self.coordinator, self.policies, self.settings.reconcile_interval_s, self._stop),
            name=f"reconcile:{self.name}",
        )

    def stop_admitting(self) -> None:
        """Shutdown, first step: held requests are answered 503 `shutting_down`, new ones refused."""
        self.coordinator.close()

    async def close(self) -> None:
        """Shutdown, last step: the reconcile loop and any lifecycle call or policy action still running end,
        then the connections to vLLM close."""
        self._stop.set()
        await self.tasks.close()
        await self.upstream.pool.close()

    @property
    def state_name(self) -> str:
        """Its state for readiness: the coordinator's, or `closed` once it stopped admitting (shutdown)."""
        return "closed" if self.gate.closed else self.coordinator.state.value

    def snapshot(self) -> dict[str, Any]:
        """`/engines/<name>/lifeguard/state`: the coordinator's view and how this engine is configured."""
        return {
            **self.coordinator.snapshot(),
            "name": self.name,
            "gpus": list(self.config.gpus),
            "pinned": self.config.pinned,
            "swap_sleep_level": self.config.swap_sleep_level,
            "footprint_bytes": self.footprint.bytes,
            "base_url": f"/engines/{self.name}/",
        }

    def _report_memory(self, reading: GpuReading) -> None:
        self.metrics.gpu_probe_available(reading.available)
        for device in reading.devices:
            self.metrics.gpu_memory(device.gpu, device.used_bytes, device.total_bytes)
