"""deploy/k8s/base/gpu-reporter.py: what it writes is what the proxy's `file:` GPU probe reads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
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


#: A stand-in `pynvml` module for the reporter run as a process: one GPU, 10 GiB of 80 in use.
FAKE_PYNVML = """
from types import SimpleNamespace
class NVMLError(Exception):
    pass
def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return index
def nvmlDeviceGetUUID(handle): return b"GPU-0000"
def nvmlDeviceGetMemoryInfo(handle, version=None): return SimpleNamespace(used=10 << 30, total=80 << 30)
"""


def run_reporter(tmp_path: Path, path: Path) -> subprocess.CompletedProcess[str]:
    """The script as the README runs it (`python3 gpu-reporter.py PATH`), once, with the stand-in NVML."""
    (tmp_path / "nvml").mkdir(exist_ok=True)
    (tmp_path / "nvml" / "pynvml.py").write_text(FAKE_PYNVML)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "nvml")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--once"], env=env, capture_output=True, text=True, timeout=60
    )


async def test_off_kubernetes_the_reporter_makes_its_directory(tmp_path: Path) -> None:
    """Was: `FileNotFoundError` and a traceback where no emptyDir made /run/lifeguard (the README's line on a host)."""
    path = tmp_path / "run" / "lifeguard" / "gpu.json"
    done = run_reporter(tmp_path, path)
    assert done.returncode == 0, done.stderr
    assert (await FileReader(path).read()).used_bytes == 10 * GIB


def test_a_directory_it_cannot_make_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = run_reporter(tmp_path, tmp_path / "a-file" / "lifeguard" / "gpu.json")
    assert done.returncode == 2
    assert done.stderr.startswith(f"gpu-reporter: cannot create {tmp_path / 'a-file' / 'lifeguard'} ("), done.stderr
    assert "--gpu-probe file:PATH" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
