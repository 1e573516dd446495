"""deploy/k8s/base/gpu-reporter.py: what it writes is what the proxy's `file:` GPU probe reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from proxy.gpu.readers import FileReader

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "gpu-reporter.py"
GIB = 1 << 30

#: The `pynvml` functions the reporter calls, for GPUs with USED GiB in use of 80 GiB each.
FAKE_PYNVML = """
import types

GIB = 1 << 30
USED, FAIL = {used_gib!r}, {fail!r}


class NVMLError(Exception):
    pass


def nvmlInit():
    if FAIL:
        raise NVMLError("Driver Not Loaded")


nvmlDeviceGetCount = lambda: len(USED)
nvmlDeviceGetHandleByIndex = lambda index: index
nvmlDeviceGetUUID = lambda handle: f"GPU-{{handle:04d}}".encode()
nvmlDeviceGetMemoryInfo = lambda handle, version=None: types.SimpleNamespace(
    used=USED[handle] * GIB, total=80 * GIB, free=(80 - USED[handle]) * GIB
)
"""


def run_reporter(tmp_path: Path, pynvml_source: str, path: Path) -> subprocess.CompletedProcess[str]:
    """`python3 gpu-reporter.py PATH --once` as the vLLM container runs it, with `pynvml_source` as its pynvml."""
    stand_in = tmp_path / "nvml"
    stand_in.mkdir()
    (stand_in / "pynvml.py").write_text(pynvml_source)
    env = {**os.environ, "PYTHONPATH": str(stand_in)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--once"], env=env, capture_output=True, text=True, timeout=30
    )


async def test_the_proxy_reads_what_the_reporter_writes(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    done = run_reporter(tmp_path, FAKE_PYNVML.format(used_gib=[70, 71, 69, 70], fail=False), path)
    assert done.returncode == 0, done.stderr
    written = json.loads(path.read_text())
    assert [device["uuid"] for device in written["devices"]] == ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]
    reading = await FileReader(path).read()
    assert reading.available
    assert reading.used_bytes == 280 * GIB
    assert reading.total_bytes == 320 * GIB
    assert len(reading.devices) == 4


async def test_an_nvml_failure_leaves_no_stale_numbers(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"used_bytes": 1, "total_bytes": 2, "devices": []}))
    done = run_reporter(tmp_path, FAKE_PYNVML.format(used_gib=[1], fail=True), path)
    assert done.returncode == 1
    assert "NVML error, retrying every 5 s: Driver Not Loaded" in done.stderr
    assert not path.exists()
    reading = await FileReader(path).read()
    assert not reading.available


def test_without_pynvml_the_reporter_exits_without_a_file(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    done = run_reporter(tmp_path, 'raise ImportError("No module named pynvml")', path)  # ahead of the venv's
    assert done.returncode == 1
    assert "gpu-reporter: pynvml not installed" in done.stderr
    assert not path.exists()


ONE_GPU = FAKE_PYNVML.format(used_gib=[10], fail=False)


async def test_off_kubernetes_the_reporter_makes_its_directory(tmp_path: Path) -> None:
    """Was: `FileNotFoundError` and a traceback where no emptyDir made /run/lifeguard (the README's line on a host)."""
    path = tmp_path / "run" / "lifeguard" / "gpu.json"
    done = run_reporter(tmp_path, ONE_GPU, path)
    assert done.returncode == 0, done.stderr
    assert (await FileReader(path).read()).used_bytes == 10 * GIB


def test_a_directory_it_cannot_make_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = run_reporter(tmp_path, ONE_GPU, tmp_path / "a-file" / "lifeguard" / "gpu.json")
    assert done.returncode == 2
    assert done.stderr.startswith(f"gpu-reporter: cannot create {tmp_path / 'a-file' / 'lifeguard'} ("), done.stderr
    assert "--gpu-probe file:PATH" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
