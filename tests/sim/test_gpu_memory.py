"""Simulated GPU memory and the ``--gpu-file`` across sleep levels and tag-wise wakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sim.conftest import SimFactory

GIB = 1 << 30
AWAKE, ASLEEP = 58 * GIB, 2 * GIB  # 16 weights + 40 KV + 2 overhead


def _used(path: Path) -> int:
    document = json.loads(path.read_text())
    assert document["total_bytes"] == 80 * GIB
    assert document["devices"] == [
        {"index": 0, "uuid": "GPU-sim-0", "used_bytes": document["used_bytes"], "total_bytes": 80 * GIB}
    ]
    return int(document["used_bytes"])


async def test_gpu_file_is_written_at_start(make_sim: SimFactory, tmp_path: Path) -> None:
    await make_sim(gpu_file=tmp_path / "gpu.json")
    assert _used(tmp_path / "gpu.json") == AWAKE


@pytest.mark.parametrize(("level", "used"), [(0, AWAKE), (1, ASLEEP), (2, ASLEEP)])
async def test_sleep_frees_memory_by_level(make_sim: SimFactory, tmp_path: Path, level: int, used: int) -> None:
    sim = await make_sim(gpu_file=tmp_path / "gpu.json")
    await sim.api.sleep(level)
    assert _used(tmp_path / "gpu.json") == used
    await sim.api.wake()
    assert _used(tmp_path / "gpu.json") == AWAKE


async def test_wake_by_tag_restores_that_part(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim(gpu_file=tmp_path / "gpu.json")
    await sim.api.sleep(2)
    await sim.api.wake("weights")
    assert _used(tmp_path / "gpu.json") == ASLEEP + 16 * GIB
    await sim.api.wake("kv_cache")
    assert _used(tmp_path / "gpu.json") == AWAKE


async def test_without_sleep_mode_sleep_frees_nothing(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim(gpu_file=tmp_path / "gpu.json", sleep_mode=False)
    answer = await sim.api.sleep(1)
    assert answer.status == 200
    assert await sim.api.is_sleeping()
    assert _used(tmp_path / "gpu.json") == AWAKE


async def test_sizes_follow_the_settings(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim(gpu_file=tmp_path / "gpu.json", weights_gib=1, kv_gib=3, overhead_gib=0.5)
    assert _used(tmp_path / "gpu.json") == int(4.5 * GIB)
    await sim.api.sleep(1)
    assert _used(tmp_path / "gpu.json") == GIB // 2


async def test_gpu_file_writes_leave_no_temporary_files(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim(gpu_file=tmp_path / "gpu.json")
    for _ in range(3):
        await sim.api.sleep(1)
        await sim.api.wake()
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]
