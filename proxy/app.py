"""`Lifeguard`: one running proxy: its engines (proxy/lifecycle/engine.py), what stands above them, and the front on
its listening socket (proxy/front/connection.py). No globals: tests build as many as they like.

Start: the engines (each starts finding out what its vLLM is), then the socket. Shutdown: the socket stops
accepting; every engine answers its held requests 503 `shutting_down` and refuses new ones; exchanges in
progress (streams included) get `shutdown_grace_s`; then every connection closes, the engines' loops and
calls end, and the connections to vLLM close.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from prometheus_client import CollectorRegistry

from . import __version__
from .config import Settings
from .config.startup_errors import cannot_listen, state_file_problem
from .front.dispatcher import Front
from .front.engine_set import EngineSet
from .front.listener import Listener, listening_sockets
from .front.model_directory import ModelDirectory
from .front.route_table import LIFECYCLE_PATHS, build_table
from .front.routing import Router
from .gpu.readers import GpuMemoryReader, make_engine_reader, make_reader
from .lifecycle.engine import Engine
from .lifecycle.states import TRANSITIONS, State
from .observe.metrics import Metrics
from .sharing.arbiter import Arbiter
from .sharing.gpu_lock import GpuLocks, open_node_locks


class Lifeguard:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        gpu: GpuMemoryReader | None = None,
    ) -> None:
        """`gpu`: the reader of the GPUs' device totals (default: `settings.gpu_probe`)."""
        self.settings = settings
        self.engine_settings = settings.guarded_engines()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._gpu = gpu
        self._session: aiohttp.ClientSession | None = None
        self._listeners: list[Listener] = []
        self.engine_set: EngineSet | None = None
        self.front: Front | None = None

    @property
    def engines(self) -> dict[str, Engine]:
        assert self.engine_set is not None, "Lifeguard.start() first"
        return self.engine_set.engines

    @property
    def port(self) -> int:
        assert self._listeners, "Lifeguard.start() first"
        port: int = self._listeners[0].sock.getsockname()[1]
        return port

    async def start(self, host: str, port: int, *, backlog: int = 4096, sock: socket.socket | None = None) -> None:
        """Bind `host:port` (or take `sock`), check what the settings need of this machine, build and start the
        engines, then listen. A `StartupError` says what stopped the start; nothing is left open behind it."""
        socks = [sock] if sock is not None else _bound(host, port)
        try:
            await self._start_engines()
        except BaseException:
            for bound in socks:
                bound.close()
            raise
        assert self.front is not None
        for listening in socks:
            listening.listen(backlog)
            self._listeners.append(Listener(listening, self.front.protocol))

    async def _start_engines(self) -> None:
        settings = self.settings
        for config in self.engine_settings:
            state_file = settings.for_engine(config).state_file
            problem = state_file_problem(state_file) if state_file else None
            if problem is not None:
                raise problem
        devices = self._gpu or make_reader(settings.gpu_probe, settings.gpu_devices)
        # Several pods on the node share GPUs (gpu_lock_dir): checked first, so a bad setting stops the start.
        gpus = [gpu for engine in self.engine_settings for gpu in engine.gpus]
        node = await open_node_locks(settings.gpu_lock_dir, devices, settings.gpu_probe, settings.gpu_devices, gpus)
        names = [engine.name for engine in self.engine_settings]
        metrics = Metrics(
            self.registry,
            version=__version__,
            engines=names,
            states=[s.value for s in State],
            operations=sorted(set(LIFECYCLE_PATHS.values())),
            edges=_edges(),
        )
        # The engines' own calls to vLLM (lifecycle, verification, canary, model lookup): few, each with a deadline.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=settings.upstream_max_connections, keepalive_timeout=settings.upstream_keepalive_s
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
            auto_decompress=False,
        )
        # Beside other engines (here, or other pods' on the node) its GPUs are shared.
        shared = len(self.engine_settings) > 1 or node is not None
        engines = {
            config.name: Engine(
                settings.for_engine(config),
                config,
                metrics=metrics.engine(config.name),
                # Alone, an engine's memory is the devices'; beside others, only its own share can say.
                gpu=make_engine_reader(settings.gpu_probe, config.name, config.upstream, settings.gpu_devices)
                if shared
                else devices,
                session=self._session,
            )
            for config in self.engine_settings
        }
        locks = GpuLocks(settings.lifecycle_queue_timeout_s, node, on_wait=metrics.gpu_lock_waited)
        self.engine_set = EngineSet(
            settings=settings,
            engines=engines,
            arbiter=Arbiter(settings, engines, devices, metrics, locks) if shared else None,
            directory=ModelDirectory(engines),
            router=Router(engines, build_table(settings.routes.items(), unknown_routes=settings.unknown_routes)),
            metrics=metrics,
        )
        self.front = Front(self.engine_set)
        for engine in engines.values():
            engine.start()

    async def close(self) -> None:
        """Stop accepting, answer what is held, give what runs `shutdown_grace_s`, then close everything."""
        for listener in self._listeners:
            await listener.close()
        if self.engine_set is not None:
            for engine in self.engine_set.engines.values():
                engine.stop_admitting()
        if self.front is not None:
            await self.front.drain(self.settings.shutdown_grace_s)
        if self.engine_set is not None:
            await self.engine_set.tasks.close()
            await asyncio.gather(*(engine.close() for engine in self.engine_set.engines.values()))
        if self._session is not None:
            await self._session.close()


def _bound(host: str, port: int) -> list[socket.socket]:
    try:
        return listening_sockets(host, port)
    except OSError as exc:
        raise cannot_listen(host, port, exc, port_flag="--port (LIFEGUARD_PORT)") from exc


def _edges() -> list[tuple[str, str]]:
    edges = set()
    for t in TRANSITIONS:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for src in sources:
            if src is not t["dest"]:
                edges.add((src.value, t["dest"].value))
    return sorted(edges)
