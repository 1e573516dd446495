"""Two real vLLM servers behind one lifeguard with ``engines:`` (docs/model-swap.md): requests alternate
between their models, and each one for the sleeping model swaps it in.

The session's vLLM (served name ``tiny``) is engine ``policy``; a second vLLM on the same tiny model, served
as ``tiny-judge``, is engine ``judge``. Both are declared on GPU 0.

Admission runs without a GPU reading (``--gpu-probe none``), on purpose. A CPU has no NVML, and sleep on
CPU frees no memory (docs/real-vllm.md). A GPU file written by the test would therefore show the same use
before and after every sleep, and the swap would be refused as "does not fit". Without a reading, the
arbiter's rule for unknown memory applies (swap_rules.plan_room): every engine on that GPU that may sleep is
put to sleep, each sleep verified, before the wake. That is the "only one fits" case, and it asks nothing of
CPU memory. What is read here comes from each vLLM directly: ``/is_sleeping`` (exactly one awake after each
swap), its sleep and wake counters, and its request counters (a sleeping engine got no request).

The same two vLLMs then stand for two pods on one GPU node (docs/gpu-sharing-across-pods.md): each behind its
own lifeguard, the two lifeguards sharing nothing but one ``gpu_lock_dir``. A CPU has no NVML, so the GPU is
named by ``gpu_devices`` (a UUID) and admission has no device reading: the lock serializes the wakes, and
whether a wake fits follows the known footprints of each proxy's own engines only.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.lifeguard_testing import missing
from tests.vllm.conftest import Proxy, free_port, reset_vllm, vllm_server_mod
from tests.vllm.vllm_e2e import get_json, metric, metrics, parse_metrics, post, sleep_ops

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

JUDGE_MODEL = "tiny-judge"
POLICY_MODEL = vllm_server_mod.SERVED_MODEL_NAME


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """{"policy": the session's vLLM, "judge": a second vLLM}, both awake and idle. The judge is spawned
    before the session's vLLM is asked for, so the two start side by side when neither runs yet."""
    if not os.environ.get("LIFEGUARD_VLLM_PYTHON") or not os.environ.get("LIFEGUARD_VLLM_MODEL"):
        missing("LIFEGUARD_VLLM_PYTHON/LIFEGUARD_VLLM_MODEL unset: run `make test-vllm`")
    log_dir = Path(os.environ.get("LIFEGUARD_VLLM_LOG_DIR") or tempfile.mkdtemp(prefix="lifeguard-vllm-"))
    judge = vllm_server_mod.VllmServer(log_path=log_dir / "vllm-judge.log", served_model_name=JUDGE_MODEL)
    judge.spawn()
    try:
        policy = request.getfixturevalue("vllm_server")
        judge.wait_healthy()
        sys.stderr.write(f"\n[vllm] judge healthy on {judge.url} after {judge.starts[-1]:.1f} s\n")
        reset_vllm(policy)
        yield {"policy": policy, "judge": judge}
        reset_vllm(policy)  # the session's vLLM goes back awake for the modules after this one
    finally:
        judge.stop()


def _start_swap_proxy(engines: dict[str, Any], tmp_path: Path, **settings: Any) -> Proxy:
    """One lifeguard of `engines:` in front of the real vLLMs, `settings` added to its configuration."""
    config = tmp_path / "lifeguard.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engines": [{"name": name, "upstream": server.url, "gpus": [0]} for name, server in engines.items()],
                "gpu_probe": "none",
                # A real vLLM on two shared cores answers late: the deadlines are generous, never missing.
                "hold_timeout_s": 180,
                "lifecycle_queue_timeout_s": 180,
                "verify_timeout_s": 60,
                "canary_timeout_s": 60,
                **settings,
            }
        )
    )
    proxy = Proxy(port=free_port(), upstream="", log_path=tmp_path / "proxy.log", config=config)
    proxy.start(timeout=60)
    return proxy


@pytest.fixture
def swap_proxy(engines: dict[str, Any], tmp_path: Path) -> Iterator[Proxy]:
    proxy = _start_swap_proxy(engines, tmp_path)
    try:
        yield proxy
    finally:
        proxy.stop()


async def _awake(session: aiohttp.ClientSession, engines: dict[str, Any]) -> dict[str, bool]:
    """Which vLLMs say they are awake, asked directly."""
    return {
        name: not (await get_json(session, server.url + "/is_sleeping"))["is_sleeping"]
        for name, server in engines.items()
    }


async def _books(session: aiohttp.ClientSession, server: Any) -> dict[str, float]:
    """What one vLLM itself counts: sleeps, wakes, and the requests it has finished or holds."""
    samples = await metrics(session, server.url)
    return {
        "sleeps": sleep_ops(samples, "sleep"),
        "wakes": sleep_ops(samples, "wake"),
        "finished": metric(samples, "vllm:request_success_total"),
        "prompt_tokens": metric(samples, "vllm:prompt_tokens_total"),
        "in_engine": metric(samples, "vllm:num_requests_running") + metric(samples, "vllm:num_requests_waiting"),
    }


async def test_requests_alternating_between_two_models_swap_them_one_verified_sleep_and_wake_each(
    engines: dict[str, Any], swap_proxy: Proxy, session: aiohttp.ClientSession
) -> None:
    base = swap_proxy.url
    listing = await get_json(session, base + "/v1/models")
    assert {m["id"] for m in listing["data"]} == {POLICY_MODEL, JUDGE_MODEL}

    # Both vLLMs start awake; the trainer's own call through the judge's base URL puts it to sleep.
    status, body, _ = await post(session, base + "/engines/judge/sleep", params={"level": "1"})
    assert status == 200, body
    assert await _awake(session, engines) == {"policy": True, "judge": False}

    serving = {"policy": POLICY_MODEL, "judge": JUDGE_MODEL}
    swaps = {"policy": 0, "judge": 0}
    for target in ("judge", "policy", "judge", "policy"):
        other = "policy" if target == "judge" else "judge"
        before = {name: await _books(session, server) for name, server in engines.items()}
        status, body, headers = await post(
            session,
            base + "/v1/completions",
            json={"model": serving[target], "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=aiohttp.ClientTimeout(total=240),
        )
        assert status == 200, (status, body, swap_proxy.log_tail())
        assert body["model"] == serving[target]
        swaps[target] += 1

        # Exactly one awake, the one asked for; vLLM's own counters show one sleep, then one wake.
        assert await _awake(session, engines) == {target: True, other: False}
        after = {name: await _books(session, server) for name, server in engines.items()}
        assert after[other]["sleeps"] == before[other]["sleeps"] + 1
        assert after[target]["wakes"] == before[target]["wakes"] + 1
        assert (after[target]["sleeps"], after[other]["wakes"]) == (before[target]["sleeps"], before[other]["wakes"])
        # The engine put to sleep got nothing after it was last asked (it was idle then): no request, no token.
        for key in ("finished", "prompt_tokens"):
            assert after[other][key] == before[other][key], (other, key, before[other], after[other])
        assert after[other]["in_engine"] == 0
        # The request (and the wake's canary) ran on the one awake.
        assert after[target]["finished"] >= before[target]["finished"] + 1

        # The proxy verified the sleep, then the wake.
        state = await get_json(session, base + "/lifeguard/state")
        assert {n: e["state"] for n, e in state["engines"].items()} == {target: "RUNNING", other: "SLEEPING"}
        assert state["gpus"]["0"]["awake"] == [target]
        slept, woke = state["engines"][other]["last_verification"], state["engines"][target]["last_verification"]
        assert slept["passed"] and woke["passed"], (slept, woke)
        assert slept["at"] <= woke["at"]
        assert "canary" in {check["name"] for check in woke["checks"]}, woke

    samples = parse_metrics(await (await session.get(base + "/lifeguard/metrics")).text())
    for name, count in swaps.items():
        assert metric(samples, "lifeguard_swaps_total", engine=name, outcome="ok") == count
    # The judge's first sleep was the trainer's call, not a swap: no swap failed or was refused.
    assert metric(samples, "lifeguard_swaps_total", outcome="failed") == 0
    assert metric(samples, "lifeguard_swaps_total", outcome="no_room") == 0


async def test_mixed_traffic_over_two_real_vllms_is_all_answered_each_swap_a_verified_sleep_then_wake(
    engines: dict[str, Any], tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """Clients ask for both models at once, at random, with the default drain: every request is answered 200
    (none refused because the other engine was busy), and each swap is a sleep then a wake, verified, as vLLM's
    own counters show."""
    # The default turn is 10 s: short here to see several turns in one test.
    proxy = _start_swap_proxy(engines, tmp_path, swap_quantum_s=2)
    try:
        status, body, _ = await post(session, proxy.url + "/engines/judge/sleep", params={"level": "1"})
        assert status == 200, body
        before = {name: await _books(session, server) for name, server in engines.items()}
        rng = random.Random(5)
        models = [POLICY_MODEL, JUDGE_MODEL]

        async def client(picks: list[str]) -> list[int]:
            statuses = []
            for model in picks:
                status, body, _ = await post(
                    session,
                    proxy.url + "/v1/completions",
                    json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0},
                    timeout=aiohttp.ClientTimeout(total=240),
                )
                assert status != 200 or body["model"] == model
                statuses.append(status)
            return statuses

        results = await asyncio.gather(*(client([rng.choice(models) for _ in range(3)]) for _ in range(4)))
        assert [s for statuses in results for s in statuses] == [200] * 12, (results, proxy.log_tail())
        after = {name: await _books(session, server) for name, server in engines.items()}
        samples = parse_metrics(await (await session.get(proxy.url + "/lifeguard/metrics")).text())
        assert metric(samples, "lifeguard_swaps_total", outcome="failed") == 0
        assert metric(samples, "lifeguard_swaps_total", outcome="no_room") == 0
        for name in engines:
            woken = after[name]["wakes"] - before[name]["wakes"]
            assert metric(samples, "lifeguard_swaps_total", engine=name, outcome="ok") == woken
        # Each wake followed a sleep of the other: one more sleep than wakes at most, per engine.
        wakes = sum(after[n]["wakes"] - before[n]["wakes"] for n in engines)
        sleeps = sum(after[n]["sleeps"] - before[n]["sleeps"] for n in engines)
        assert wakes >= 1 and sleeps in (wakes, wakes + 1)
        assert sum((await _awake(session, engines)).values()) == 1  # one awake: never both
        state = await get_json(session, proxy.url + "/lifeguard/state")
        for engine in state["engines"].values():
            assert engine["last_verification"]["passed"], engine["last_verification"]
    finally:
        proxy.stop()


@pytest.fixture
def pod_proxies(engines: dict[str, Any], tmp_path: Path) -> Iterator[tuple[dict[str, Proxy], Path]]:
    """One lifeguard per vLLM, as one per pod, on one lock directory (the node's hostPath)."""
    lock_dir = tmp_path / "gpu-locks"
    lock_dir.mkdir()
    proxies: dict[str, Proxy] = {}
    try:
        for name, server in engines.items():
            config = tmp_path / f"lifeguard-{name}.yaml"
            config.write_text(
                yaml.safe_dump(
                    {
                        "engines": [{"name": name, "upstream": server.url, "gpus": [0], "footprint_gib": 1}],
                        "gpu_lock_dir": str(lock_dir),
                        "gpu_devices": ["GPU-cpu-node-0"],  # no NVML to name it: Proxy runs --gpu-probe none
                        "hold_timeout_s": 180,
                        "lifecycle_queue_timeout_s": 180,
                        "verify_timeout_s": 60,
                        "canary_timeout_s": 60,
                        "log_level": "info",
                    }
                )
            )
            proxies[name] = Proxy(port=free_port(), upstream="", log_path=tmp_path / f"proxy-{name}.log", config=config)
            proxies[name].start(timeout=60)
        yield proxies, lock_dir
    finally:
        for proxy in proxies.values():
            proxy.stop()


async def test_two_lifeguards_on_one_lock_directory_serialize_racing_wakes_of_their_vllms(
    engines: dict[str, Any], pod_proxies: tuple[dict[str, Proxy], Path], session: aiohttp.ClientSession
) -> None:
    """Both vLLMs asleep. The GPU is held by a third party on the node (a trainer's weight sync, as the test
    takes the lock file itself); a wake sent to each lifeguard at once waits, nothing reaching either vLLM.
    Let go, both wakes run, one after the other: the second waited for the first lifeguard's engine (its log
    names it), and vLLM's own counters show one wake each."""
    proxies, lock_dir = pod_proxies
    for name, proxy in proxies.items():
        status, body, _ = await post(session, proxy.url + "/sleep", params={"level": "1"})
        assert status == 200, (name, body, proxy.log_tail())
    assert await _awake(session, engines) == {"policy": False, "judge": False}
    before = {name: await _books(session, server) for name, server in engines.items()}

    lock_file = lock_dir / "GPU-cpu-node-0.lock"
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        holder = {"host": "trainer-pod", "pid": os.getpid(), "engine": "trainer", "op": "weight_sync",
                  "since": time.time()}  # fmt: skip
        os.write(fd, json.dumps(holder).encode())
        racing = {
            name: asyncio.ensure_future(post(session, proxy.url + "/wake_up", timeout=aiohttp.ClientTimeout(total=240)))
            for name, proxy in proxies.items()
        }
        for name, proxy in proxies.items():
            deadline = time.monotonic() + 60
            while True:
                state = await get_json(session, proxy.url + "/lifeguard/state")
                queued = [t for t in state["swap_queue"] if t["op"] == "wake_up" and not t["running"]]
                if queued and state["gpu_lock"]["gpus"]["0"]["holder"]["host"] == "trainer-pod":
                    break
                assert time.monotonic() < deadline, (name, state, proxy.log_tail())
                await asyncio.sleep(0.1)
        assert not any(f.done() for f in racing.values())
        assert await _awake(session, engines) == {"policy": False, "judge": False}  # nothing reached vLLM
    finally:
        os.close(fd)  # the kernel lets the lock go with the descriptor
    answers = {name: await future for name, future in racing.items()}
    assert {name: status for name, (status, _, _) in answers.items()} == {"policy": 200, "judge": 200}, answers
    assert await _awake(session, engines) == {"policy": True, "judge": True}
    after = {name: await _books(session, server) for name, server in engines.items()}
    assert all(after[n]["wakes"] == before[n]["wakes"] + 1 for n in engines), (before, after)

    # Serialized: whichever went second waited for the first lifeguard's wake, and says so.
    logs = {name: proxy.log_path.read_text(errors="replace") for name, proxy in proxies.items()}
    second = [name for name, text in logs.items() if any(
        "gpu_lock_waited" in line and f"engine {other} (wake_up)" in line
        for other in proxies if other != name for line in text.splitlines())]  # fmt: skip
    assert len(second) == 1, {name: [line for line in text.splitlines() if "gpu_lock_waited" in line]
                              for name, text in logs.items()}  # fmt: skip
    for name, proxy in proxies.items():
        samples = parse_metrics(await (await session.get(proxy.url + "/lifeguard/metrics")).text())
        assert metric(samples, "lifeguard_gpu_lock_waits_total", engine=name, outcome="waited") >= 1
