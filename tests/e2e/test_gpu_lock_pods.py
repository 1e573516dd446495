"""Several pods on one GPU node (`gpu_lock_dir`, docs/gpu-sharing-across-pods.md): each "pod" is a real
`vllm-lifeguard serve` process guarding its own simulator, all simulators on one shared GPU file (the device
as every pod's NVML would see it), all proxies on one lock directory (the hostPath). Nothing is shared between
the proxies but that directory and the device.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine as SimEngine
from proxy.observe.status_cli import render
from tests.e2e.conftest import BIG, FAST_SIM, GIB, MEDIUM

BIN = Path(sys.executable).with_name("vllm-lifeguard")
TIMEOUT = aiohttp.ClientTimeout(total=40)
PROXY_ENV = {
    "LIFEGUARD_RECONCILE_INTERVAL_S": "0.2",
    "LIFEGUARD_VERIFY_TIMEOUT_S": "2",
    "LIFEGUARD_VERIFY_POLL_INTERVAL_S": "0.01",
    "LIFEGUARD_HOLD_TIMEOUT_S": "10",
    "LIFEGUARD_LIFECYCLE_QUEUE_TIMEOUT_S": "20",
    "LIFEGUARD_LOG_LEVEL": "info",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pod:
    """One pod: a simulator and the lifeguard in front of it."""

    name: str
    sim_server: TestServer
    proc: asyncio.subprocess.Process
    base: str
    log: Path
    wakes: list[tuple[float, float]] = field(default_factory=list)  # (began, ended) of each wake in the sim

    @property
    def sim(self) -> SimEngine:
        engine: SimEngine = self.sim_server.app[SIM_ENGINE]
        return engine

    def sim_count(self, op: str) -> int:
        counters: dict[str, int] = self.sim.state_dict()["counters"]  # type: ignore[assignment]
        return int(counters.get(op, 0))


@dataclass
class Node:
    pods: dict[str, Pod]
    session: aiohttp.ClientSession
    gpu_file: Path
    lock_dir: Path

    async def state(self, name: str) -> dict[str, Any]:
        async with self.session.get(self.pods[name].base + "/lifeguard/state") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def call(self, name: str, op: str, **params: str) -> tuple[int, str | None, dict[str, Any]]:
        async with self.session.post(self.pods[name].base + "/" + op, params=params) as resp:
            return resp.status, resp.headers.get("X-Lifeguard-Reason"), await resp.json()

    async def wait_for(self, name: str, check: Callable[[dict[str, Any]], bool], timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state = await self.state(name)
            if check(state):
                return state
            assert time.monotonic() < deadline, f"{name}: condition not reached in {timeout} s: {state}"
            await asyncio.sleep(0.02)

    def device(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.gpu_file.read_text())
        return document

    async def metric(self, name: str, series: str) -> float:
        async with self.session.get(self.pods[name].base + "/lifeguard/metrics") as resp:
            text = await resp.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


MakeNode = Callable[..., Awaitable[Node]]


@pytest.fixture
async def make_node(aiohttp_server: Any, tmp_path: Path) -> AsyncIterator[MakeNode]:
    procs: list[asyncio.subprocess.Process] = []
    logs: list[Any] = []
    session = aiohttp.ClientSession(timeout=TIMEOUT)

    async def make(
        pods: dict[str, tuple[str, ...]],
        *,
        sizes: dict[str, float],
        footprint_gib: float,
        wake_seconds: float = 0.01,
    ) -> Node:
        """`pods`: name -> the GPU UUIDs its engine occupies (all start asleep)."""
        gpu_file, lock_dir = tmp_path / "gpu.json", tmp_path / "gpu-locks"
        lock_dir.mkdir()
        devices = sorted({uuid for uuids in pods.values() for uuid in uuids})
        started: dict[str, Pod] = {}
        for name, uuids in pods.items():
            sim = SimSettings(**{**FAST_SIM.__dict__, "model": f"model-{name}", "gpu_file": gpu_file,
                                 "gpu_file_engine": name, "gpu_uuids": uuids, "wake_seconds": wake_seconds,
                                 **sizes})  # fmt: skip
            server = await aiohttp_server(create_sim_app(sim))
            await server.app[SIM_ENGINE].sleep(1, "abort")
            port = free_port()
            engine = {"name": name, "upstream": str(server.make_url("")).rstrip("/"), "models": [f"model-{name}"],
                      "gpus": [devices.index(uuid) for uuid in uuids], "footprint_gib": footprint_gib}  # fmt: skip
            env = {k: v for k, v in os.environ.items() if k not in ("LIFEGUARD_UPSTREAM", "LIFEGUARD_CONFIG")}
            env.update(PROXY_ENV, LIFEGUARD_PORT=str(port), LIFEGUARD_ENGINES=json.dumps([engine]),
                       LIFEGUARD_GPU_PROBE=f"file:{gpu_file}", LIFEGUARD_GPU_LOCK_DIR=str(lock_dir))  # fmt: skip
            log_path = tmp_path / f"proxy-{name}.log"
            log = log_path.open("wb")
            logs.append(log)
            proc = await asyncio.create_subprocess_exec(str(BIN), "serve", stdout=log, stderr=log, env=env)
            procs.append(proc)
            started[name] = Pod(name, server, proc, f"http://127.0.0.1:{port}", log_path)
        node = Node(started, session, gpu_file, lock_dir)
        for pod in started.values():
            _record_wakes(pod)
            deadline = time.monotonic() + 30
            while True:
                assert pod.proc.returncode is None, pod.log.read_text()[-3000:]
                try:
                    state = await node.state(pod.name)
                    if state["state"] == "SLEEPING" and not state["lifecycle_busy"]:
                        break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, f"proxy {pod.name} never saw its engine asleep"
                await asyncio.sleep(0.05)
        return node

    yield make
    await session.close()
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    for log in logs:
        log.close()


def _record_wakes(pod: Pod) -> None:
    """Each wake the simulator runs, from its start to its end, as the simulator's journal records it."""
    original = pod.sim.wake_up

    async def wake_up(tags: list[str] | None) -> dict[str, object]:
        began = time.monotonic()
        try:
            return await original(tags)
        finally:
            pod.wakes.append((began, time.monotonic()))

    pod.sim.wake_up = wake_up  # type: ignore[method-assign]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


@pytest.mark.parametrize("count", [2, 3])
async def test_racing_wakes_through_several_proxies_wake_one_and_refuse_the_others_before_their_simulators(
    make_node: MakeNode, count: int
) -> None:
    """One simulated GPU that fits one engine awake (50 of 80 GiB), one proxy per engine. Wakes sent at once
    to every proxy: one wakes; each other waited for the node's lock, then found the memory taken by another
    pod's engine and refused 503 insufficient_gpu_memory, its simulator never asked. Three rounds, the winner
    put to sleep between them."""
    names = "abc"[:count]
    node = await make_node({n: ("GPU-sim-0",) for n in names}, sizes=BIG, footprint_gib=50, wake_seconds=0.3)
    total = node.device()["total_bytes"]
    winners = []
    for _ in range(3):
        before = {n: node.pods[n].sim_count("wake_up") for n in names}
        answers = dict(zip(names, await asyncio.gather(*(node.call(n, "wake_up") for n in names)), strict=True))
        won = [n for n, (status, _, _) in answers.items() if status == 200]
        assert len(won) == 1, answers
        winner = won[0]
        winners.append(winner)
        for name, (status, reason, body) in answers.items():
            if name == winner:
                continue
            assert (status, reason) == (503, "insufficient_gpu_memory"), (name, status, body)
            assert "memory held outside this proxy" in body["error"]["message"], body
            assert node.pods[name].sim_count("wake_up") == before[name], f"a wake reached {name}'s simulator"
            assert (await node.state(name))["state"] == "SLEEPING"
        assert node.pods[winner].sim_count("wake_up") == before[winner] + 1
        assert [n for n in names if not node.pods[n].sim.is_sleeping] == [winner]
        assert node.device()["used_bytes"] <= total
        assert (await node.call(winner, "sleep", level="1"))[0] == 200
    waited = {n: await node.metric(n, f'lifeguard_gpu_lock_waits_total{{engine="{n}",outcome="waited"}}')
              for n in names}  # fmt: skip
    # A loser's wake found the winner's 0.3 s wake holding the GPU: waited for it, then was refused.
    assert sum(waited.values()) >= 2 * (count - 1), waited
    logged = [n for n in names if "waited" in node.pods[n].log.read_text() and "node's GPU lock" in
              node.pods[n].log.read_text()]  # fmt: skip
    assert logged, "no proxy logged a wait for another pod"


async def test_a_proxy_killed_9_while_holding_the_gpu_lets_another_proxys_wake_proceed_at_once(
    make_node: MakeNode,
) -> None:
    """Two engines that fit together (38 GiB each). Proxy a holds the GPU through a wake its simulator makes
    slow (20 s); proxy b's wake waits for it, its state naming a's process as the holder. kill -9 of proxy a:
    the kernel frees its lock, and b's wake reaches its simulator long before a's slow wake would have ended."""
    node = await make_node({"a": ("GPU-sim-0",), "b": ("GPU-sim-0",)}, sizes=MEDIUM, footprint_gib=38)
    a, b = node.pods["a"], node.pods["b"]
    a.sim.set_faults(["wake_up:slow:20"])
    slow = asyncio.ensure_future(node.call("a", "wake_up"))
    await node.wait_for("b", lambda s: (s["gpu_lock"]["gpus"]["0"]["holder"] or {}).get("pid") == a.proc.pid)
    # What b's `vllm-lifeguard status` shows of it (the status page draws the same label on its GPU bar).
    seen_by_b = await node.state("b")
    holder = seen_by_b["gpu_lock"]["gpus"]["0"]["holder"]
    assert (holder["engine"], holder["op"]) == ("a", "wake_up"), holder
    assert f"lock: a (wake_up) on {holder['host']}" in render(seen_by_b), render(seen_by_b)
    waiting = asyncio.ensure_future(node.call("b", "wake_up"))
    await node.wait_for("b", lambda s: any(t["engine"] == "b" and not t["running"] for t in s["swap_queue"]))
    assert b.sim_count("wake_up") == 0 and not waiting.done()

    a.proc.send_signal(signal.SIGKILL)
    try:
        async with asyncio.timeout(10):  # a's wake holds its simulator for 20 s: only the kill can free the GPU
            while b.sim_count("wake_up") == 0:
                await asyncio.sleep(0.005)
    except TimeoutError:
        pytest.fail("b's wake did not reach its simulator after proxy a was killed")
    assert (await asyncio.wait_for(waiting, 20))[0] == 200
    assert not b.sim.is_sleeping
    with pytest.raises(aiohttp.ClientError):
        await slow  # its proxy died: the client sees its connection cut, never an answer
    lock = (await node.state("b"))["gpu_lock"]["gpus"]["0"]
    assert lock["held"] is False and lock["holder"] is None


async def test_an_engine_on_two_gpus_and_one_on_each_never_deadlock_nor_wake_at_once_on_a_gpu(
    make_node: MakeNode,
) -> None:
    """x (tensor parallel) on GPU-sim-0 and GPU-sim-1, y on GPU-sim-0, z on GPU-sim-1; all fit together.
    Five rounds of slow wakes sent to all three at once, then sleeps: every call answers 200 (nothing waits
    forever, nothing times out), x's wakes never overlap y's or z's, and y's and z's (different GPUs) do."""
    sizes = {"weights_gib": 8, "kv_gib": 20, "overhead_gib": 2, "total_gib": 80}  # 30 awake (x: 15 per GPU)
    pods = {"x": ("GPU-sim-0", "GPU-sim-1"), "y": ("GPU-sim-0",), "z": ("GPU-sim-1",)}
    node = await make_node(pods, sizes=sizes, footprint_gib=30, wake_seconds=0.2)
    for _ in range(5):
        woken = await asyncio.wait_for(asyncio.gather(*(node.call(n, "wake_up") for n in pods)), 30)
        assert [status for status, _, _ in woken] == [200, 200, 200], woken
        slept = await asyncio.gather(*(node.call(n, "sleep", level="1") for n in pods))
        assert [status for status, _, _ in slept] == [200, 200, 200], slept
    x, y, z = (node.pods[n].wakes for n in "xyz")
    assert len(x) == len(y) == len(z) == 5
    assert not _overlap(x, y) and not _overlap(x, z)
    assert _overlap(y, z), "the lock is per GPU: y's and z's wakes on different GPUs should have run together"
    state = await node.state("x")
    assert {g["uuid"] for g in state["gpu_lock"]["gpus"].values()} == {"GPU-sim-0", "GPU-sim-1"}
    assert state["gpus"]["1"]["total_bytes"] == 80 * GIB


async def test_a_lock_directory_that_cannot_work_stops_the_start_naming_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LIFEGUARD_UPSTREAM", "LIFEGUARD_CONFIG")}
    gpu_file = tmp_path / "gpu.json"
    gpu_file.write_text(json.dumps({"devices": [{"index": 0, "used_bytes": 0, "total_bytes": 80 * GIB}]}))
    missing = tmp_path / "missing"
    cases = [
        ({"LIFEGUARD_GPU_LOCK_DIR": str(missing)}, 1, f"gpu_lock_dir {missing} does not exist"),
        ({"LIFEGUARD_GPU_LOCK_DIR": str(tmp_path), "LIFEGUARD_GPU_PROBE": f"file:{gpu_file}"}, 1,
         "GPU 0: the probe names no UUID for it"),
        ({"LIFEGUARD_GPU_LOCK_DIR": str(tmp_path), "LIFEGUARD_GPU_PROBE": "none"}, 2, "gpu_probe none reads no UUID"),
    ]  # fmt: skip
    for extra, code, message in cases:
        proc = await asyncio.create_subprocess_exec(
            str(BIN), "serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
            stderr=asyncio.subprocess.PIPE, env={**env, "LIFEGUARD_GPU_PROBE": "nvml", **extra},
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == code, err.decode()
        assert message in err.decode(), err.decode()
