"""deploy/k8s/base/gpu-reporter.py: what it writes is what the proxy's `file:` GPU probe reads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from proxy.gpu.readers import FileReader

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "gpu-reporter.py"
GIB = 1 << 30


class NVMLError(Exception):
    pass


def fake_pynvml(used_gib: list[int], fail: bool = False) -> ModuleType:
    """The `pynvml` functions the reporter calls, for GPUs with `used_gib` in use of 80 GiB each."""
    module = ModuleType("pynvml")

    def init() -> None:
        if fail:
            raise NVMLError("Driver Not Loaded")

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(used_gib)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle:04d}".encode()  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda handle, version=None: SimpleNamespace(  # type: ignore[attr-defined]
        used=used_gib[handle] * GIB, total=80 * GIB, free=(80 - used_gib[handle]) * GIB
    )
    return module


@pytest.fixture
def reporter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_reporter", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_proxy_reads_what_the_reporter_writes(
    reporter: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([70, 71, 69, 70]))
    path = tmp_path / "gpu.json"
    assert reporter.main([str(path), "--once"]) == 0
    written = json.loads(path.read_text())
    assert [device["uuid"] for device in written["devices"]] == ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]
    reading = await FileReader(path).read()
    assert reading.available
    assert reading.used_bytes == 280 * GIB
    assert reading.total_bytes == 320 * GIB
    assert len(reading.devices) == 4


async def test_an_nvml_failure_leaves_no_stale_numbers(
    reporter: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"used_bytes": 1, "total_bytes": 2, "devices": []}))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([1], fail=True))
    assert reporter.main([str(path), "--once"]) == 1
    assert not path.exists()
    reading = await FileReader(path).read()
    assert not reading.available


def test_without_pynvml_the_reporter_exits_without_a_file(
    reporter: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    path = tmp_path / "gpu.json"
    assert reporter.main([str(path), "--once"]) == 1
    assert not path.exists()
