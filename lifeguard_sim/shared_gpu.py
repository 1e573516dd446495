"""Several simulators on one device (``--gpu-file PATH --gpu-file-engine NAME``): one GPU file, each engine's
own use under ``engines`` and the device's use the sum of them, so the proxy reads device totals where it
would read NVML and each engine's share where it verifies that engine.

A wake that would take the device past its total fails as vLLM's does (500 ``CUDA Error: out of memory``)
and leaves the engine asleep; one that fits takes its memory in the same locked step as that check
(``claim``), before the wake's duration, as vLLM allocates while it wakes. Simulators in separate
processes update the file under an exclusive ``flock`` on ``PATH.lock``, each read-modify-write done
without yielding.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lifeguard_sim.memory import write_gpu_file


class SharedGpuFile:
    def __init__(self, path: Path, engine: str, total_bytes: int) -> None:
        self._path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._engine = engine
        self._total = total_bytes

    def publish(self, own: dict[str, Any]) -> int:
        """Write this engine's use (``own``: its ``snapshot()``) and the device's new sum; returns that sum."""
        with self._locked():
            return self._write(self._read(), own)

    def claim(self, own: dict[str, Any]) -> int | None:
        """Publish ``own`` only if the other engines leave room for it, in one locked step (a vLLM starting
        beside others takes its memory, or fails its startup check of free memory; a wake allocates what it
        maps back): the device's new sum, or None when there was no room."""
        with self._locked():
            document = self._read()
            if self._others(document) + int(own["used_bytes"]) > self._total:
                return None
            return self._write(document, own)

    def _others(self, document: dict[str, Any]) -> int:
        engines = document.get("engines", {})
        return sum(int(entry["used_bytes"]) for name, entry in engines.items() if name != self._engine)

    def _write(self, document: dict[str, Any], own: dict[str, Any]) -> int:
        engines = document.get("engines", {})
        engines[self._engine] = own
        used = sum(int(entry["used_bytes"]) for entry in engines.values())
        device = {"index": 0, "uuid": "GPU-sim-0", "used_bytes": used, "total_bytes": self._total}
        write_gpu_file(
            self._path,
            {"used_bytes": used, "total_bytes": self._total, "devices": [device], "engines": engines},
        )
        return used

    def _read(self) -> dict[str, Any]:
        try:
            document = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return {}
        return document if isinstance(document, dict) else {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
