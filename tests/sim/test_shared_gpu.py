"""Several simulators on one device (``--gpu-file-engine``): one GPU file, the device total shared, and a
wake that does not fit fails as vLLM's does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.sim.conftest import Sim, SimFactory

GIB = 1 << 30
SIZES = {"weights_gib": 16, "kv_gib": 32, "overhead_gib": 2, "total_gib": 80}  # awake 50, asleep 2


def _document(path: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads(path.read_text())
    return document


def _engine_use(path: Path, name: str) -> int:
    engines = _document(path)["engines"]
    assert isinstance(engines, dict)
    return int(engines[name]["used_bytes"])


async def _a_asleep_then_b(make_sim: SimFactory, gpu: Path, **a_settings: Any) -> tuple[Sim, Sim]:
    """Engine a on the shared GPU file, put to sleep; then engine b, awake: the device holds 2 + 50 GiB of 80."""
    a = await make_sim(model="a", gpu_file=gpu, gpu_file_engine="a", **a_settings, **SIZES)
    await a.api.sleep(1)
    b = await make_sim(model="b", gpu_file=gpu, gpu_file_engine="b", **SIZES)
    return a, b


async def test_each_engine_writes_its_own_use_and_the_device_shows_the_sum(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    gpu = tmp_path / "gpu.json"
    await _a_asleep_then_b(make_sim, gpu)
    document = _document(gpu)
    assert (_engine_use(gpu, "a"), _engine_use(gpu, "b")) == (2 * GIB, 50 * GIB)
    assert document["used_bytes"] == 52 * GIB and document["total_bytes"] == 80 * GIB
    assert document["devices"] == [{"index": 0, "uuid": "GPU-sim-0", "used_bytes": 52 * GIB, "total_bytes": 80 * GIB}]


async def test_a_wake_that_does_not_fit_is_vllms_out_of_memory_and_the_engine_stays_asleep(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    gpu = tmp_path / "gpu.json"
    a, b = await _a_asleep_then_b(make_sim, gpu)
    refused = await a.api.wake()
    assert refused.status == 500
    assert "CUDA Error: out of memory" in json.dumps(refused.body)
    state = await a.state()
    assert state["is_sleeping"] is True and state["asleep_tags"] == ["kv_cache", "weights"]
    assert _engine_use(gpu, "a") == 2 * GIB
    await b.api.sleep(1)  # room made: now it fits
    assert (await a.api.wake()).status == 200
    assert _engine_use(gpu, "a") == 50 * GIB and _document(gpu)["used_bytes"] == 52 * GIB


async def test_with_oom_wedges_every_later_wake_fails_until_a_restart(make_sim: SimFactory, tmp_path: Path) -> None:
    gpu = tmp_path / "gpu.json"
    a, b = await _a_asleep_then_b(make_sim, gpu, oom_wedges=True)
    assert (await a.api.wake()).status == 500
    await b.api.sleep(1)  # room made, but the engine is wedged
    wedged = await a.api.wake()
    assert wedged.status == 500 and "out of memory" in json.dumps(wedged.body)
    assert (await a.state())["wedged"] == ["wake_up"]
    a.engine.restart()
    assert not a.engine.is_sleeping and _engine_use(gpu, "a") == 50 * GIB


def test_a_claim_takes_the_memory_only_when_the_others_leave_room(tmp_path: Path) -> None:
    """What the chaos run's restarter does before it starts a simulator beside others: a vLLM that starts
    takes its memory, or fails its startup check of free memory."""
    from lifeguard_sim.memory import GpuMemory
    from lifeguard_sim.shared_gpu import SharedGpuFile

    gpu = tmp_path / "gpu.json"
    awake = GpuMemory(**SIZES).snapshot()
    asleep = {**awake, "used_bytes": 2 * GIB}
    a, b = SharedGpuFile(gpu, "a", 80 * GIB), SharedGpuFile(gpu, "b", 80 * GIB)
    assert a.claim(awake) == 50 * GIB
    assert b.claim(awake) is None  # 50 + 50 > 80: nothing written
    assert _document(gpu)["used_bytes"] == 50 * GIB and "b" not in _document(gpu)["engines"]  # type: ignore[operator]
    assert a.publish(asleep) == 2 * GIB
    assert b.claim(awake) == 52 * GIB
    assert (_engine_use(gpu, "a"), _engine_use(gpu, "b")) == (2 * GIB, 50 * GIB)


async def test_two_wakes_at_once_on_a_full_device_take_their_memory_in_the_locked_check(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    """Two-engine chaos run, seed 5 (100 of 80 GiB): the wake checked the file, slept its duration, then
    published, so another engine's claim or wake landed between the check and the allocation and both got
    in. A wake now takes its memory in the same locked step as the check: of two wakes that overlap, one
    runs out of memory, and the device never holds more than its total."""
    gpu = tmp_path / "gpu.json"
    slow = {**SIZES, "wake_seconds": 0.5}
    a = await make_sim(model="a", gpu_file=gpu, gpu_file_engine="a", **slow)
    b = await make_sim(model="b", gpu_file=gpu, gpu_file_engine="b", **slow)
    await a.api.sleep(1)
    await b.api.sleep(1)
    sums: list[int] = []  # the device's sum at every write of either engine
    for sim in (a, b):
        shared = sim.engine._shared
        assert shared is not None
        publish, claim = shared.publish, shared.claim

        def published(own: dict[str, Any], publish: Any = publish) -> int:
            sums.append(publish(own))
            return sums[-1]

        def claimed(own: dict[str, Any], claim: Any = claim) -> int | None:
            device: int | None = claim(own)
            sums.extend([device] if device is not None else [])
            return device

        shared.publish, shared.claim = published, claimed  # type: ignore[method-assign]
    # Both checks land inside the other's 0.5 s wake: neither has published when the other checks.
    statuses = sorted(r.status for r in await asyncio.gather(a.api.wake(), b.api.wake()))
    assert statuses == [200, 500]
    assert _document(gpu)["used_bytes"] == 52 * GIB
    assert sums and max(sums) <= 80 * GIB


async def test_devices_are_named_by_uuid_and_an_engine_on_two_takes_a_share_of_each(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    """The devices as NVML names them, so that several proxies' `gpu_lock_dir` lock files (named by UUID) are
    the same for one device; an engine on two GPUs (tensor parallel) takes half its use on each, and its wake
    fits only where both have room."""
    gpu = tmp_path / "gpu.json"
    both = await make_sim(model="x", gpu_file=gpu, gpu_file_engine="x", gpu_uuids=("GPU-sim-0", "GPU-sim-1"), **SIZES)
    await both.api.sleep(1)  # 2 GiB: 1 on each
    bigger = {**SIZES, "kv_gib": 42}  # 60 GiB awake
    await make_sim(model="y", gpu_file=gpu, gpu_file_engine="y", gpu_uuids=("GPU-sim-1",), **bigger)
    document = _document(gpu)
    assert document["devices"] == [
        {"index": 0, "uuid": "GPU-sim-0", "used_bytes": 1 * GIB, "total_bytes": 80 * GIB},
        {"index": 1, "uuid": "GPU-sim-1", "used_bytes": 61 * GIB, "total_bytes": 80 * GIB},
    ]
    assert document["used_bytes"] == 62 * GIB and document["total_bytes"] == 160 * GIB
    engines = document["engines"]
    assert isinstance(engines, dict)
    assert [d["used_bytes"] for d in engines["x"]["devices"]] == [1 * GIB, 1 * GIB]
    # Awake it takes 25 GiB on each: 60 + 25 > 80 on GPU-sim-1, though GPU-sim-0 has room.
    refused = await both.api.wake()
    assert refused.status == 500 and "out of memory" in json.dumps(refused.body)
    assert _document(gpu)["used_bytes"] == 62 * GIB
