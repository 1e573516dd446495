"""The CPU path of `scripts/gpu-check.sh`: the memory engine's books (pretend backend), the check run
in-process against the real proxy app, and the script's own dry run end to end.

The physical path (torch allocations read through NVML) needs a GPU and is run by the script itself
on a machine that has one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from proxy.app import create_app
from proxy.config import Settings

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_memory_engine", ROOT / "scripts" / "gpu_memory_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gme = _load()


def engine(tmp_path: Path, **kwargs: Any) -> Any:
    backend = gme.PretendBackend({"weights": 4 * GIB, "kv_cache": 4 * GIB}, tmp_path / "gpu.json")
    return gme.MemoryEngine(backend, **kwargs)


def file_used(tmp_path: Path) -> int:
    return int(json.loads((tmp_path / "gpu.json").read_text())["used_bytes"])


# ----- the engine's books
def test_level1_sleep_frees_both_and_a_wake_brings_the_same_weights_back(tmp_path: Path) -> None:
    e = engine(tmp_path)
    assert file_used(tmp_path) == 9 * GIB

    e.sleep(1)
    assert (e.is_sleeping, e.paused, e.asleep_tags, file_used(tmp_path)) == (True, True, {"weights", "kv_cache"}, GIB)
    e.wake_up(None)

    assert (e.is_sleeping, file_used(tmp_path)) == (False, 9 * GIB)
    assert e.answer() == gme.GOOD_ANSWER


def test_level2_discards_the_weights_until_reload(tmp_path: Path) -> None:
    e = engine(tmp_path)
    e.sleep(2)
    e.wake_up(["weights"])
    assert e.is_sleeping and e.asleep_tags == {"kv_cache"} and file_used(tmp_path) == 5 * GIB
    assert e.answer() == gme.GARBLED_ANSWER

    e.reload_weights()
    e.wake_up(["kv_cache"])

    assert not e.is_sleeping and e.answer() == gme.GOOD_ANSWER


def test_reload_while_the_weights_sleep_is_an_error(tmp_path: Path) -> None:
    e = engine(tmp_path)
    e.sleep(2)
    with pytest.raises(gme.web.HTTPInternalServerError):
        e.reload_weights()


def test_unknown_tags_and_repeated_sleeps_are_vllms_silent_noops(tmp_path: Path) -> None:
    e = engine(tmp_path)
    e.sleep(1)
    e.sleep(2)
    assert e.sleep_level == 1 and e.weights_valid
    e.wake_up(["weights,kv_cache"])
    assert e.asleep_tags == {"weights", "kv_cache"} and file_used(tmp_path) == GIB


def test_a_lying_sleep_flips_the_flags_and_frees_nothing(tmp_path: Path) -> None:
    e = engine(tmp_path, lies={"sleep"})
    e.sleep(1)
    assert e.is_sleeping and file_used(tmp_path) == 9 * GIB


def test_a_lying_wake_flips_the_flags_and_restores_nothing(tmp_path: Path) -> None:
    e = engine(tmp_path)
    e.sleep(1)
    e.once.add("wake_up")

    e.wake_up(None)
    assert not e.is_sleeping and file_used(tmp_path) == GIB
    e.sleep(1)  # the one-shot lie is spent: the next round is honest
    e.wake_up(None)
    assert file_used(tmp_path) == 9 * GIB


def test_judge_step_wants_the_memory_check_to_have_run() -> None:
    step = gme.STEPS[0]
    state = {"state": "SLEEPING", "last_verification": {"checks": []}}

    assert gme.judge_step(step, 200, "health=pass,flags=pass,memory=pass", state) == []
    assert gme.judge_step(step, 200, "health=pass,flags=pass,memory=unavailable", state) == [
        "memory check 'unavailable' in X-Lifeguard-Verified 'health=pass,flags=pass,memory=unavailable'"
    ]


# ----- the check, in-process, against the real proxy
async def _run_check(tmp_path: Path, aiohttp_server: Any, gpu_probe: str) -> dict[str, Any]:
    e = engine(tmp_path)
    engine_server: TestServer = await aiohttp_server(gme.create_engine_app(e))
    settings = Settings(
        upstream=str(engine_server.make_url("")).rstrip("/"),
        gpu_probe=gpu_probe,
        reconcile_interval_s=0.1,
        verify_timeout_s=0.3,
        verify_poll_interval_s=0.01,
    )
    proxy_server: TestServer = await aiohttp_server(create_app(settings))
    report: dict[str, Any] = await gme.run_check(
        str(proxy_server.make_url("")).rstrip("/"), str(engine_server.make_url("")).rstrip("/"), deadline_s=30
    )
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
        timeout=90,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["ok"] and report["mode"] == "dry-run" and report["gpu_probe"] == "file"
    assert report["physical"] == {"available": False, "reason": "--dry-run asked"}
    assert len(report["steps"]) == len(gme.STEPS)
    assert report["seconds"] < 60
