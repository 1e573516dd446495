"""The proxy in front of an in-process simulator, both on loopback test servers.

`make_stack(**settings)` builds one; `Stack` has the helpers tests use to wait on conditions (always
polling with a deadline, never a fixed sleep). The proxy listens as `vllm-lifeguard serve` runs it
(`LifeguardServer`, tests/conftest.py); `stack.lifeguard` is the running proxy, `stack.engine` its one engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.app import Lifeguard
from proxy.config import Settings
from proxy.lifecycle.engine import Engine as GuardedEngine
from tests.chaos import chaos_checks, sim_process
from tests.lifeguard_testing import LifeguardServer, ServeLifeguard

#: Short rounds and deadlines for every proxy under test, single- or several-engine.
TEST_TIMINGS: dict[str, Any] = {
    "reconcile_interval_s": 0.2,
    "verify_timeout_s": 1.0,
    "verify_poll_interval_s": 0.01,
    "hold_timeout_s": 10.0,
}
FAST_SIM = SimSettings(token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.01)


class ProxyState:
    """`/lifeguard/state` of the proxy under test, read now or polled until a predicate holds."""

    client: TestClient

    async def state(self) -> dict[str, Any]:
        token = lifeguard_of(self.client).settings.admin_token  # the state needs it when one is set
        headers = {"X-Lifeguard-Token": token.get_secret_value()} if token is not None else {}
        resp = await self.client.get("/lifeguard/state", headers=headers)
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


def lifeguard_of(client: TestClient) -> Lifeguard:
    server = client.server
    assert isinstance(server, LifeguardServer)
    return server.lifeguard


@dataclass
class Stack(ProxyState):
    client: TestClient
    sim_server: TestServer
    settings: Settings
    # Calls the proxy's own start-up round made before the test began (its canary, its reset of the prefix cache).
    baseline: dict[str, int] = field(default_factory=dict)

    @property
    def lifeguard(self) -> Lifeguard:
        return lifeguard_of(self.client)

    @property
    def engine(self) -> GuardedEngine:
        """The one engine the proxy guards."""
        (engine,) = self.lifeguard.engines.values()
        return engine

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

    def completion_in_background(self, **extra: Any) -> asyncio.Task[ClientResponse]:
        """`completion(**extra)` as a task, which ends once the whole answer is read."""

        async def post() -> ClientResponse:
            resp: ClientResponse = await self.completion(**extra)
            await resp.read()
            return resp

        return asyncio.ensure_future(post())

    def faults(self, *specs: str) -> None:
        self.sim.set_faults(list(specs))

    def sim_count(self, op: str) -> int:
        """Calls of `op` the engine saw since the test began (not counting the proxy's start-up round)."""
        return self._counters().get(op, 0) - self.baseline.get(op, 0)

    def _counters(self) -> dict[str, int]:
        counters: dict[str, int] = self.sim.state_dict()["counters"]  # type: ignore[assignment]
        return counters


def held_until(release: asyncio.Event, call: Callable[..., Awaitable[Any]], timeout: float = 10.0) -> Any:
    """`call` (a simulator engine's method) that first waits for `release`, at most `timeout` s: as in
    `engine.wake_up = held_until(release, engine.wake_up)`, to see the proxy while the call is under way."""

    async def held(*args: Any, **kwargs: Any) -> Any:
        await asyncio.wait_for(release.wait(), timeout)
        return await call(*args, **kwargs)

    return held


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


@pytest.fixture
def make_stack(aiohttp_server: Any, serve_lifeguard: ServeLifeguard, tmp_path: Path) -> Callable[..., Awaitable[Stack]]:
    async def make(sim: SimSettings | None = None, ready: tuple[str, ...] = (), **overrides: Any) -> Stack:
        """`ready`: the states the proxy may settle in first, where an engine does not start RUNNING."""
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
        settings = Settings(**values)
        stack = Stack(await serve_lifeguard(settings), sim_server, settings)
        # Ready = RUNNING and the start-up round (which records the golden canary) has finished. With an idle
        # auto-sleep the engine may already be asleep again by the first look: settled is ready then.
        ready = ready or (("RUNNING", "SLEEPING") if settings.idle_sleep_after_s is not None else ("RUNNING",))
        await stack.wait_for(lambda s: s["state"] in ready and not s["lifecycle_busy"])
        stack.baseline = dict(stack._counters())
        return stack

    return make


# --- several engines on one simulated GPU (proxy/sharing/arbiter.py)

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
    # Each simulator's journal, as the chaos run writes it (tests/chaos/sim_process.py).
    journals: dict[str, Path]

    @property
    def lifeguard(self) -> Lifeguard:
        return lifeguard_of(self.client)

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

    def unexcused_violations(self) -> dict[str, list[dict[str, Any]]]:
        """Each engine's violations but those the chaos run excuses, by its own rule (`known_violation`: a request
        in transit, that reached vLLM while a pause or sleep ran or within `IN_TRANSIT_S` after it)."""
        found: dict[str, list[dict[str, Any]]] = {}
        for name, path in self.journals.items():
            journal = chaos_checks.read_journal(path, name)
            unexcused = [v for v in journal.violations if not chaos_checks.known_violation(v, journal.pausing)]
            if unexcused:
                found[name] = unexcused
        return found


@pytest.fixture
def make_engines(
    aiohttp_server: Any, serve_lifeguard: ServeLifeguard, tmp_path: Path
) -> Callable[..., Awaitable[EnginesStack]]:
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
        gpu_file = tmp_path / "gpu.json"
        sims: dict[str, TestServer] = {}
        journals: dict[str, Path] = {}
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
            # Journaled from here: a sleep before the proxy started has no request in transit across it.
            journals[name] = tmp_path / f"journal-{name}.jsonl"
            sim_process.instrument(sims[name].app[SIM_ENGINE], sim_process.Journal(str(journals[name])))
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
        stack = EnginesStack(await serve_lifeguard(Settings(**values)), sims, gpu_file, journals)
        expected = {name: "SLEEPING" if name in asleep else "RUNNING" for name in names}
        await stack.wait_for(
            lambda s: (
                {n: e["state"] for n, e in s["engines"].items()} == expected
                and not any(e["lifecycle_busy"] for e in s["engines"].values())
            )
        )
        return stack

    return make
