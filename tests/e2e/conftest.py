"""The proxy in front of an in-process simulator, both on loopback test servers.

`make_stack(**settings)` builds one; `Stack` has the helpers tests use to wait on conditions (always
polling with a deadline, never a fixed sleep). The proxy serves its socket with the data plane that
`LIFEGUARD_TEST_DATA_PLANE` names (`raw`: the llhttp front of proxy/front.py with the aiohttp application
behind proxy/seam.py; `aiohttp`), or the default setting's when unset.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.app import create_app
from proxy.config import Settings
from proxy.seam import RawDataPlane

#: Short rounds and deadlines for every proxy under test, single- or several-engine.
TEST_TIMINGS: dict[str, Any] = {
    "reconcile_interval_s": 0.2,
    "verify_timeout_s": 1.0,
    "verify_poll_interval_s": 0.01,
    "hold_timeout_s": 10.0,
}
FAST_SIM = SimSettings(token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.01)


class RawFrontServer(TestServer):
    """The proxy as `vllm-lifeguard serve` runs it with `data_plane: raw`, for aiohttp's TestClient."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__(app)
        self._settings = settings
        self.plane: RawDataPlane | None = None

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        if self.runner:
            return
        self.plane = RawDataPlane(self.app, self._settings)
        await self.plane.start(self.host, 0)
        self.runner = self.plane.runner
        self.port = self.plane.port
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    async def close(self) -> None:
        if self.plane is not None and not self.closed:
            await self.plane.close()
            self._root = None
            self.port = None
            self._closed = True


class ProxyState:
    """`/lifeguard/state` of the proxy under test, read now or polled until a predicate holds."""

    client: TestClient
    #: Sent with every read of the state: the admin token when the proxy under test has one.
    state_headers: dict[str, str]

    async def state(self) -> dict[str, Any]:
        resp = await self.client.get("/lifeguard/state", headers=self.state_headers)
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            snapshot = await self.state()
            if predicate(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout} s; last state: {snapshot}")
            await asyncio.sleep(0.01)


@dataclass
class Stack(ProxyState):
    client: TestClient
    sim_server: TestServer
    proxy_app: web.Application
    settings: Settings
    # Generations the proxy's own start-up canary made before the test began.
    generate_baseline: int = 0

    @property
    def state_headers(self) -> dict[str, str]:
        token = self.settings.admin_token
        return {"X-Lifeguard-Token": token.get_secret_value()} if token is not None else {}

    @property
    def sim(self) -> Engine:
        engine: Engine = self.sim_server.app[SIM_ENGINE]
        return engine

    async def wait_state(self, name: str, timeout: float = 5.0) -> dict[str, Any]:
        return await self.wait_for(lambda s: s["state"] == name, timeout)

    async def wait_held(self, count: int, timeout: float = 5.0) -> dict[str, Any]:
        return await self.wait_for(lambda s: s["held_requests"] == count, timeout)

    def completion(self, prompt: str = "hello", max_tokens: int = 4, **extra: Any) -> Awaitable[Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.client.post("/v1/completions", json=body)

    def faults(self, *specs: str) -> None:
        self.sim.set_faults(list(specs))

    def sim_count(self, op: str) -> int:
        """Calls of `op` the engine saw since the test began (not counting the start-up canary)."""
        counters: dict[str, int] = self.sim.state_dict()["counters"]  # type: ignore[assignment]
        return int(counters.get(op, 0)) - (self.generate_baseline if op == "generate" else 0)


async def raw_exchange(stack: Stack, data: bytes, *, read_for: float = 2.0, half_close: bool = False) -> bytes:
    """Send `data` as is on a fresh connection; everything the proxy answers until it closes or `read_for` s pass."""
    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(data)
    await writer.drain()
    if half_close:
        writer.write_eof()
    received = b""
    deadline = time.monotonic() + read_for
    try:
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    finally:
        writer.close()
    return received


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) else 0


def proxy_settings(**values: Any) -> Settings:
    """Settings for a proxy under test, on the data plane `LIFEGUARD_TEST_DATA_PLANE` names unless `values` do."""
    if "data_plane" not in values and os.environ.get("LIFEGUARD_TEST_DATA_PLANE"):
        values["data_plane"] = os.environ["LIFEGUARD_TEST_DATA_PLANE"]
    return Settings(**values)


async def serve_proxy(aiohttp_client: Any, app: web.Application, settings: Settings) -> TestClient:
    """`app` listening as `vllm-lifeguard serve` runs it with `settings.data_plane`, and a client for it."""
    server: TestServer
    if settings.data_plane == "raw":
        server = RawFrontServer(app, settings)
        await server.start_server()
    else:
        server = TestServer(app)
        # the idle timer is the header read deadline (proxy/cli.py)
        await server.start_server(keepalive_timeout=settings.client_idle_timeout_s)
    client: TestClient = await aiohttp_client(server)
    return client


@pytest.fixture
def make_stack(aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path) -> Callable[..., Awaitable[Stack]]:
    async def make(sim: SimSettings | None = None, **overrides: Any) -> Stack:
        gpu_file = tmp_path / "gpu.json"
        sim_settings = sim or FAST_SIM
        sim_settings = SimSettings(**{**sim_settings.__dict__, "gpu_file": gpu_file})
        sim_server = await aiohttp_server(create_sim_app(sim_settings))
        values: dict[str, Any] = {
            "upstream": str(sim_server.make_url("")).rstrip("/"),
            "gpu_probe": f"file:{gpu_file}",
            **TEST_TIMINGS,
            **overrides,
        }
        settings = proxy_settings(**values)
        app = create_app(settings)
        client = await serve_proxy(aiohttp_client, app, settings)
        stack = Stack(client, sim_server, app, settings)
        # Ready = RUNNING and the start-up round (which records the golden canary) has finished. With an idle
        # auto-sleep the engine may already be asleep again by the first look: settled is ready then.
        ready = ("RUNNING", "SLEEPING") if settings.idle_sleep_after_s is not None else ("RUNNING",)
        await stack.wait_for(lambda s: s["state"] in ready and not s["lifecycle_busy"])
        stack.generate_baseline = stack.sim_count("generate")
        return stack

    return make


# --- several engines on one simulated GPU (proxy/engines.py, proxy/arbiter.py)

GIB = 1 << 30
#: Each simulated engine takes 50 GiB awake and 2 GiB asleep on one 80 GiB device: two do not fit together.
BIG = {"weights_gib": 16, "kv_gib": 32, "overhead_gib": 2, "total_gib": 80}
#: 38 GiB awake, 2 asleep: two fit together, a third does not.
MEDIUM = {"weights_gib": 16, "kv_gib": 20, "overhead_gib": 2, "total_gib": 80}


@dataclass
class EnginesStack(ProxyState):
    client: TestClient
    sims: dict[str, TestServer]
    gpu_file: Path
    proxy_app: web.Application
    state_headers: dict[str, str] = field(default_factory=dict)

    def sim(self, name: str) -> Engine:
        engine: Engine = self.sims[name].app[SIM_ENGINE]
        return engine

    def sim_count(self, name: str, op: str) -> int:
        counters: dict[str, int] = self.sim(name).state_dict()["counters"]  # type: ignore[assignment]
        return int(counters.get(op, 0))

    def device_used(self) -> int:
        import json

        return int(json.loads(self.gpu_file.read_text())["used_bytes"])

    async def states(self) -> dict[str, str]:
        return {name: engine["state"] for name, engine in (await self.state())["engines"].items()}

    def completion(self, model: str, prompt: str = "hello", max_tokens: int = 4) -> Awaitable[Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return self.client.post("/v1/completions", json=body)

    def violations(self) -> dict[str, list[dict[str, object]]]:
        return {name: self.sim(name).violations for name in self.sims if self.sim(name).violations}


@pytest.fixture
def make_engines(aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path) -> Callable[..., Awaitable[EnginesStack]]:
    """Simulators sharing one GPU file (each engine `name` serves `model-<name>`), `asleep` ones put to sleep
    before the proxy starts, and the proxy of several engines in front of them."""

    async def make(
        names: tuple[str, ...] = ("a", "b"),
        *,
        asleep: tuple[str, ...] = ("b",),
        sizes: dict[str, float] | None = None,
        engine: dict[str, dict[str, Any]] | None = None,
        sim: dict[str, dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> EnginesStack:
        from proxy.engines import create_engines_app

        gpu_file = tmp_path / "gpu.json"
        sims: dict[str, TestServer] = {}
        for name in names:
            sim_settings = SimSettings(
                **{
                    **FAST_SIM.__dict__,
                    "model": f"model-{name}",
                    "gpu_file": gpu_file,
                    "gpu_file_engine": name,
                    **(sizes or BIG),
                    **(sim or {}).get(name, {}),
                }
            )
            sims[name] = await aiohttp_server(create_sim_app(sim_settings))
            if name in asleep:
                await sims[name].app[SIM_ENGINE].sleep(1, "abort")
        engines = [
            {
                "name": name,
                "upstream": str(sims[name].make_url("")).rstrip("/"),
                "gpus": [0],
                **(engine or {}).get(name, {}),
            }
            for name in names
        ]
        values: dict[str, Any] = {
            "engines": engines,
            "gpu_probe": f"file:{gpu_file}",
            **TEST_TIMINGS,
            **overrides,
        }
        settings = Settings(**values)
        app = create_engines_app(settings)
        server = TestServer(app)
        await server.start_server(keepalive_timeout=settings.client_idle_timeout_s)
        client = await aiohttp_client(server)
        token = settings.admin_token
        stack = EnginesStack(
            client, sims, gpu_file, app, {"X-Lifeguard-Token": token.get_secret_value()} if token is not None else {}
        )
        expected = {name: "SLEEPING" if name in asleep else "RUNNING" for name in names}
        await stack.wait_for(
            lambda s: (
                {n: e["state"] for n, e in s["engines"].items()} == expected
                and not any(e["lifecycle_busy"] for e in s["engines"].values())
            )
        )
        return stack

    return make
