"""The CPU path of `scripts/gpu-check.sh`: `scripts/gpu_check.py` run in-process against the real proxy
in front of the simulator (simulated memory, `file:` probe), and the script's own dry run end to end.

The physical path (the simulator's `--memory cuda`, read through NVML) needs a GPU and is run by the
script itself on a machine that has one; so does its step of two pods (two proxies on one `gpu_lock_dir`),
whose dry run here races the wakes on a simulated device shared by two simulators. The simulator's memory
books are tests/sim/test_gpu_memory.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from lifeguard_sim.app import SimSettings, create_sim_app
from proxy.config import Settings
from scripts import gpu_check
from tests.lifeguard_testing import LifeguardServer

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def test_judge_step_wants_the_memory_check_to_have_run() -> None:
    step = gpu_check.STEPS[0]
    state = {"state": "SLEEPING", "last_verification": {"checks": []}}

    assert gpu_check.judge_step(step, 200, "health=pass,flags=pass,memory=pass", state) == []
    assert gpu_check.judge_step(step, 200, "health=pass,flags=pass,memory=unavailable", state) == [
        "memory check 'unavailable' in X-Lifeguard-Verified 'health=pass,flags=pass,memory=unavailable'"
    ]


def test_judge_step_wants_a_lie_caught_by_the_named_check() -> None:
    lying_sleep = next(step for step in gpu_check.STEPS if step.name == "lying sleep")
    caught = {"state": "SLEEPING", "last_verification": {"checks": [{"name": "memory", "result": "fail"}]}}
    missed = {"state": "SLEEPING", "last_verification": {"checks": [{"name": "memory", "result": "pass"}]}}

    assert gpu_check.judge_step(lying_sleep, 503, None, caught) == []
    assert gpu_check.judge_step(lying_sleep, 200, None, missed) == [
        "status 200, expected 503",
        "the memory check did not fail: {'memory': 'pass'}",
    ]


@pytest.mark.skipif(gpu_check.cuda_available()[0], reason="this machine has CUDA: the simulator would allocate")
def test_the_simulator_refuses_cuda_memory_where_there_is_none() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "sim", "--memory", "cuda", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2
    assert "memory kind cuda" in done.stderr and gpu_check.cuda_available()[1] in done.stderr


# ----- the check, in-process, against the real proxy
async def _run_check(tmp_path: Path, aiohttp_server: Any, gpu_probe: str) -> dict[str, Any]:
    sim = create_sim_app(
        SimSettings(gpu_file=tmp_path / "gpu.json", weights_gib=4, kv_gib=4, overhead_gib=1, vllm_version="0.34")
    )
    engine_server: TestServer = await aiohttp_server(sim)
    settings = Settings(
        upstream=str(engine_server.make_url("")).rstrip("/"),
        gpu_probe=gpu_probe,
        reconcile_interval_s=0.1,
        verify_timeout_s=0.3,
        verify_poll_interval_s=0.01,
    )
    proxy_server = LifeguardServer(settings)
    await proxy_server.start_server()
    try:
        report: dict[str, Any] = await gpu_check.run_check(
            str(proxy_server.make_url("")).rstrip("/"), str(engine_server.make_url("")).rstrip("/"), deadline_s=30
        )
    finally:
        await proxy_server.close()
    return report


async def test_the_check_passes_when_the_proxy_reads_memory(tmp_path: Path, aiohttp_server: Any) -> None:
    report = await _run_check(tmp_path, aiohttp_server, f"file:{tmp_path}/gpu.json")

    assert report["ok"], json.dumps(report, indent=1)
    steps = {s["step"]: s for s in report["steps"]}
    assert steps["honest sleep level 1"]["device_used_bytes_after"] == GIB
    assert steps["honest sleep level 1"]["proxy_gpu_memory_used_bytes"] == GIB
    assert steps["lying sleep"]["reason"] == "verification_failed"
    assert steps["lying sleep"]["engine_flags_after"] == {"is_sleeping": True, "is_paused": True}
    assert steps["lying wake"]["proxy_state"] == "FAILED"
    assert steps["reload weights"]["verification_seconds"] is None
    assert steps["checkpoint prepare"]["device_used_bytes_after"] == 5 * GIB  # the KV cache released
    assert "snapshot=pass" in steps["checkpoint restore"]["verified"]


async def test_the_check_fails_when_the_proxy_cannot_read_memory(tmp_path: Path, aiohttp_server: Any) -> None:
    report = await _run_check(tmp_path, aiohttp_server, "none")

    assert not report["ok"]
    failing = {s["step"] for s in report["steps"] if not s["ok"]}
    assert {"honest sleep level 1", "lying sleep", "lying wake"} <= failing


# ----- the script itself, dry run
def test_the_script_dry_run_writes_its_figures(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WEIGHTS_GIB": "1", "KV_GIB": "1"}

    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,  # two phases: the single engine, then two pods
    )

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["ok"] and report["mode"] == "dry-run" and report["gpu_probe"] == "file"
    assert report["physical"] == {"available": False, "reason": "--dry-run asked"}
    assert len(report["steps"]) == len(gpu_check.STEPS)
    assert report["seconds"] < 60
    engines = json.loads((tmp_path / "gpu-check-engines.json").read_text())
    assert engines["ok"] and engines["mode"] == "dry-run", json.dumps(engines, indent=1)
    caught = engines["steps"][0]
    assert caught["statuses"] == {"a": 503, "b": 200}
    assert caught["device_used_bytes_after"] < caught["device_used_bytes_before"]  # b freed its memory meanwhile
    assert {c["name"]: c["result"] for c in caught["checks"]["a"]}["memory"] == "fail"
    assert {c["name"]: c["result"] for c in caught["checks"]["b"]}["memory"] == "pass"
    # Two pods on the (simulated) GPU, one lock directory: each round one wakes, the other is refused for memory.
    pods = json.loads((tmp_path / "gpu-check-pods.json").read_text())
    assert pods["ok"] and pods["mode"] == "dry-run" and len(pods["rounds"]) == 3, json.dumps(pods, indent=1)
    for race in pods["rounds"]:
        statuses = sorted(answer["status"] for answer in race["answers"].values())
        assert statuses == [200, 503] and sorted(race["wakes_reached_the_simulator"].values()) == [0, 1]
        assert {lock["gpus"]["0"]["uuid"] for lock in race["gpu_lock"].values()} == {"GPU-sim-0"}


def test_judge_race_wants_one_wake_and_the_others_refused_before_their_simulators() -> None:
    one = {"a": (200, None), "b": (503, "insufficient_gpu_memory")}
    assert gpu_check.judge_race(one, {"a": 1, "b": 0}) == []
    assert gpu_check.judge_race(one, {"a": 1, "b": 1}) == ["b: its simulator ran 1 wake(s), expected 0"]
    both = {"a": (200, None), "b": (200, None)}
    assert gpu_check.judge_race(both, {"a": 1, "b": 1})[0].startswith("2 wakes answered 200")
    busy = {"a": (200, None), "b": (409, "lifecycle_busy")}
    refused = gpu_check.judge_race(busy, {"a": 1, "b": 0})
    assert refused == ["b: 409 lifecycle_busy, expected 503 insufficient_gpu_memory"]
