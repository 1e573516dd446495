"""GPU memory readers: NVML through a faked `pynvml` (its functions are replaced, not our wrapper), the
simulator's memory file, and the `--gpu-probe` choices.

This machine has no NVIDIA driver, so one test takes the real `pynvml` path: the library is missing,
and that must read as "unavailable", never raise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from proxy.gpu.readers import (
    FileReader,
    GpuReading,
    NoGpuReader,
    NvmlReader,
    SharedGpuReader,
    make_engine_reader,
    make_reader,
)

GIB = 1 << 30


@dataclass
class FakeNvml:
    """Two GPUs; `used` per index, and an error to raise from the next call of a given function."""

    used: list[int] = field(default_factory=lambda: [10 * GIB, 30 * GIB])
    uuids: tuple[str, ...] = ("GPU-aaaa", "GPU-bbbb")
    total: int = 80 * GIB
    inits: int = 0
    fail: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code, raised once

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlInit", self.init)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", self.count)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", self.by_index)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", self.by_uuid)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self.memory)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", self.uuid)

    def _maybe_fail(self, name: str) -> None:
        code = self.fail.pop(name, None)
        if code is not None:
            raise pynvml.NVMLError(code)

    def init(self) -> None:
        self._maybe_fail("init")
        self.inits += 1

    def count(self) -> int:
        self._maybe_fail("count")
        return len(self.used)

    def by_index(self, index: int) -> int:
        self._maybe_fail("by_index")
        if not 0 <= index < len(self.used):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def by_uuid(self, uuid: str) -> int:
        self._maybe_fail("by_uuid")
        if uuid not in self.uuids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.uuids.index(uuid)

    def uuid(self, handle: int) -> bytes:
        self._maybe_fail("uuid")
        return self.uuids[handle].encode()  # older nvidia-ml-py answers bytes

    def memory(self, handle: int, version: Any = None) -> SimpleNamespace:
        self._maybe_fail("memory")
        used = self.used[handle]
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    fake.install(monkeypatch)
    return fake


# ----- NVML
async def test_nvml_reads_every_visible_gpu_by_default(nvml: FakeNvml) -> None:
    reading = await NvmlReader().read()

    assert reading.available
    assert [(d.gpu, d.used_bytes, d.total_bytes) for d in reading.devices] == [
        ("0", 10 * GIB, 80 * GIB),
        ("1", 30 * GIB, 80 * GIB),
    ]
    assert reading.used_bytes == 40 * GIB and reading.total_bytes == 160 * GIB


async def test_nvml_watches_only_the_selected_index(nvml: FakeNvml) -> None:
    reading = await NvmlReader(("1",)).read()

    assert [(d.gpu, d.used_bytes) for d in reading.devices] == [("1", 30 * GIB)]


async def test_nvml_selects_devices_by_uuid(nvml: FakeNvml) -> None:
    reading = await NvmlReader(("GPU-bbbb", "GPU-aaaa")).read()

    assert [(d.gpu, d.used_bytes) for d in reading.devices] == [("GPU-bbbb", 30 * GIB), ("GPU-aaaa", 10 * GIB)]


async def test_nvml_initialises_once_and_follows_memory_between_reads(nvml: FakeNvml) -> None:
    reader = NvmlReader()
    await reader.read()
    nvml.used[0] = 2 * GIB

    reading = await reader.read()

    assert reading.used_bytes == 32 * GIB
    assert nvml.inits == 1


async def test_nvml_unknown_uuid_is_unavailable_not_an_error(nvml: FakeNvml) -> None:
    reading = await NvmlReader(("GPU-nope",)).read()

    assert not reading.available
    assert reading.unavailable is not None and "Not Found" in reading.unavailable
    assert reading.devices == ()


async def test_nvml_gpu_lost_mid_run_is_unavailable_then_recovers(nvml: FakeNvml) -> None:
    reader = NvmlReader()
    assert (await reader.read()).available
    nvml.fail["memory"] = pynvml.NVML_ERROR_GPU_IS_LOST

    lost = await reader.read()

    assert not lost.available
    assert lost.unavailable == "NVML: GPU is lost"
    assert lost.as_dict()["available"] is False and lost.as_dict()["unavailable_reason"] == "NVML: GPU is lost"
    back = await reader.read()
    assert back.available and back.used_bytes == 40 * GIB
    assert nvml.inits == 1  # handles are looked up again; NVML itself stays initialised


async def test_nvml_transient_init_error_is_retried_on_the_next_read(nvml: FakeNvml) -> None:
    reader = NvmlReader()
    nvml.fail["init"] = pynvml.NVML_ERROR_UNKNOWN

    assert not (await reader.read()).available
    assert (await reader.read()).available


async def test_nvml_driver_not_loaded_is_unavailable_and_not_retried(nvml: FakeNvml) -> None:
    reader = NvmlReader()
    nvml.fail["init"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED

    first = await reader.read()
    second = await reader.read()

    assert not first.available and "Driver Not Loaded" in (first.unavailable or "")
    assert second.unavailable == first.unavailable
    assert nvml.inits == 0  # the driver does not appear later in this process: no init storm


async def test_nvml_with_no_gpu_visible_is_unavailable(nvml: FakeNvml) -> None:
    nvml.used = []

    reading = await NvmlReader().read()

    assert not reading.available
    assert reading.unavailable is not None and "no GPU" in reading.unavailable


async def test_nvml_library_missing_on_this_machine_is_unavailable_never_an_error() -> None:
    """The real pynvml, unpatched: this host has no libnvidia-ml.so."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - only on a machine with a driver
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML; the missing-library path cannot be observed here")
    reader = NvmlReader()

    reading = await reader.read()

    assert not reading.available
    assert reading.unavailable == "NVML: NVML Shared Library Not Found"
    assert (await reader.read()).unavailable == reading.unavailable


# ----- the simulator's file
def _write(path: Path, payload: Any) -> Path:
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


async def test_file_reader_reads_the_simulators_devices(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "gpu.json",
        {
            "used_bytes": 58 * GIB,
            "total_bytes": 80 * GIB,
            "devices": [{"index": 0, "uuid": "GPU-sim-0", "used_bytes": 58 * GIB, "total_bytes": 80 * GIB}],
        },
    )

    reading = await FileReader(path).read()

    assert reading.available
    assert [(d.gpu, d.used_bytes, d.total_bytes) for d in reading.devices] == [("GPU-sim-0", 58 * GIB, 80 * GIB)]


async def test_file_reader_without_devices_uses_the_totals(tmp_path: Path) -> None:
    path = _write(tmp_path / "gpu.json", {"used_bytes": 3, "total_bytes": 8})

    reading = await FileReader(path).read()

    assert [(d.gpu, d.used_bytes, d.total_bytes) for d in reading.devices] == [("0", 3, 8)]


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{not json",
        {"used_bytes": 3},
        {"devices": [{"index": 0, "used_bytes": "lots", "total_bytes": 8}]},
        [1, 2],
        "42",
        "null",
    ],
    ids=["empty", "not-json", "no-total", "bad-number", "a-list", "a-number", "null"],
)
async def test_file_reader_bad_file_is_unavailable(tmp_path: Path, content: Any) -> None:
    path = _write(tmp_path / "gpu.json", content)

    reading = await FileReader(path).read()

    assert not reading.available
    assert reading.unavailable is not None and str(path) in reading.unavailable


async def test_file_reader_missing_file_is_unavailable(tmp_path: Path) -> None:
    reading = await FileReader(tmp_path / "absent.json").read()

    assert not reading.available and "absent.json" in (reading.unavailable or "")


# ----- choices
async def test_make_reader_choices(tmp_path: Path) -> None:
    none = make_reader("none")
    assert isinstance(none, NoGpuReader)
    assert (await none.read()) == GpuReading(unavailable="gpu probe disabled (--gpu-probe none)")
    file_reader = make_reader(f"file:{tmp_path}/gpu.json")
    assert isinstance(file_reader, FileReader)
    nvml_reader = make_reader("nvml", ("0", "GPU-aaaa"))
    assert isinstance(nvml_reader, NvmlReader) and nvml_reader.devices == ("0", "GPU-aaaa")


async def test_a_file_whose_writer_stopped_is_unavailable_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    fresh = {"used_bytes": 5, "total_bytes": 10, "devices": [], "updated_at": time.time()}
    path.write_text(json.dumps(fresh))
    assert (await FileReader(path).read()).available
    path.write_text(json.dumps({**fresh, "updated_at": time.time() - 60}))
    reading = await FileReader(path).read()
    assert not reading.available and "old" in (reading.unavailable or "")


async def test_one_engine_of_several_reads_its_own_entry_of_a_shared_gpu_file(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    own = {"used_bytes": 5, "total_bytes": 80, "devices": [{"index": 0, "used_bytes": 5, "total_bytes": 80}]}
    path.write_text(json.dumps({"used_bytes": 55, "total_bytes": 80, "engines": {"a": own}}))
    upstream = "http://127.0.0.1:8000"
    reading = await make_engine_reader(f"file:{path}", "a", upstream).read()
    assert reading.available and reading.used_bytes == 5 and reading.total_bytes == 80
    missing = await make_engine_reader(f"file:{path}", "b", upstream).read()
    assert not missing.available and "engine 'b'" in (missing.unavailable or "")
    path.write_text(json.dumps({"used_bytes": 55, "total_bytes": 80, "engines": ["not", "a", "map"]}))
    assert not (await make_engine_reader(f"file:{path}", "a", upstream).read()).available


async def test_with_nvml_an_engine_elsewhere_has_no_memory_of_its_own_one_in_the_pod_reads_its_processes() -> None:
    elsewhere = make_engine_reader("nvml", "a", "http://10.0.0.7:8000")
    assert isinstance(elsewhere, SharedGpuReader)
    assert "shared by several engines" in ((await elsewhere.read()).unavailable or "")
    here = make_engine_reader("nvml", "a", "http://127.0.0.1:8001", ("GPU-aaaa",))
    assert isinstance(here, NvmlReader) and here.processes is not None and here.processes.port == 8001
    assert here.devices == ("GPU-aaaa",)
    assert isinstance(make_engine_reader("none", "a", "http://127.0.0.1:8001"), NoGpuReader)


# ----- NVML per process: one engine's own memory on a shared GPU
class Pids:
    """An engine's processes as proxy/gpu/processes.py finds them (a fixed set here)."""

    def __init__(self, port: int, *pids: int) -> None:
        self.port = port
        self.now = frozenset(pids)

    def pids(self) -> frozenset[int]:
        return self.now


@pytest.fixture
def per_process(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> dict[int, list[tuple[int, int | None]]]:
    """NVML's compute processes per device handle: (pid, used bytes or None when NVML cannot tell)."""
    listed: dict[int, list[tuple[int, int | None]]] = {0: [], 1: []}

    def processes(handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in listed[handle]]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", processes)
    return listed


async def test_an_engines_own_memory_is_what_its_processes_hold_on_each_gpu(
    per_process: dict[int, list[tuple[int, int | None]]],
) -> None:
    per_process[0] = [(101, 20 * GIB), (102, 30 * GIB), (201, 25 * GIB), (999, None)]
    per_process[1] = [(102, 4 * GIB)]
    policy = NvmlReader(processes=Pids(8000, 101, 102))  # type: ignore[arg-type]
    judge = NvmlReader(processes=Pids(8001, 201))  # type: ignore[arg-type]
    mine = await policy.read()
    assert [(d.gpu, d.used_bytes, d.total_bytes) for d in mine.devices] == [("0", 50 * GIB, 80 * GIB),
                                                                             ("1", 4 * GIB, 80 * GIB)]  # fmt: skip
    assert (await judge.read()).used_bytes == 25 * GIB


async def test_a_lying_sleep_of_one_engine_is_caught_while_its_neighbour_frees_memory_at_the_same_moment(
    per_process: dict[int, list[tuple[int, int | None]]],
) -> None:
    """Device totals cannot tell them apart: the device drops by the honest engine's 48 GiB, which is more than
    half of the liar's own 50 GiB, so a device-level check would pass the liar's sleep too."""
    from proxy.config import Settings
    from proxy.lifecycle.verdict import CheckResult
    from proxy.lifecycle.verifier import Expectation, MemoryChange, Verifier
    from tests.unit.lifecycle.test_verifier import ASLEEP, FakeClient

    per_process[0] = [(101, 50 * GIB), (201, 50 * GIB)]
    settings = Settings(upstream="http://127.0.0.1:1", verify_timeout_s=0.05, verify_poll_interval_s=0.01)
    liar = Verifier(FakeClient([ASLEEP]), NvmlReader(processes=Pids(8000, 101)), settings)  # type: ignore[arg-type]
    honest = Verifier(FakeClient([ASLEEP]), NvmlReader(processes=Pids(8001, 201)), settings)  # type: ignore[arg-type]
    for verifier in (liar, honest):
        verifier.note_awake(await verifier.read_memory())
    per_process[0] = [(101, 50 * GIB), (201, 2 * GIB)]  # both said 200 to /sleep; only the honest one freed
    freed = Expectation(sleeping=True, paused=True, memory=MemoryChange.FREED)
    caught = await liar.verify(freed, memory_before=None)
    passed = await honest.verify(freed, memory_before=None)
    assert caught.failed is not None and caught.failed.name == "memory" and caught.failed.result is CheckResult.FAIL
    assert passed.failed is None and [c.result for c in passed.checks][-1] is CheckResult.PASS


async def test_an_engine_whose_processes_cannot_be_seen_is_unavailable_said_once(
    per_process: dict[int, list[tuple[int, int | None]]], caplog: pytest.LogCaptureFixture
) -> None:
    reader = NvmlReader(processes=Pids(8000))  # type: ignore[arg-type]
    for _ in range(3):
        reading = await reader.read()
        assert not reading.available and "shareProcessNamespace" in (reading.unavailable or "")
    said = [r for r in caplog.records if r.name == "lifeguard.gpu" and "per-engine GPU memory unavailable" in r.message]
    assert len(said) == 1
