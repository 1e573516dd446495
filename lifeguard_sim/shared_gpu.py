"""Several simulators on shared devices (``--gpu-file PATH --gpu-file-engine NAME``): one GPU file, each engine's
own use under ``engines`` and each device's use the sum of the shares on it, so the proxy reads device totals
where it would read NVML and each engine's share where it verifies that engine.

Devices are named by UUID, as NVML names them (``--gpu-uuid``, repeatable; default one device,
``GPU-sim-0``): an engine on several (tensor parallel) takes an equal share of its use on each, and the file
lists every device any engine names, in UUID order (their index). Several proxies on one node (each with its
own simulators) read the same file; their ``gpu_lock_dir`` lock files are named by these UUIDs.

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

DEFAULT_UUIDS = ("GPU-sim-0",)


class SharedGpuFile:
    def __init__(self, path: Path, engine: str, total_bytes: int, uuids: tuple[str, ...] = DEFAULT_UUIDS) -> None:
        """``total_bytes``: each device's; ``uuids``: the devices this engine occupies."""
        self._path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._engine = engine
        self._total = total_bytes
        self._uuids = tuple(uuids)

    def publish(self, own: dict[str, Any]) -> int:
        """Write this engine's use (``own``: its ``snapshot()``) and the devices' new sums; returns the most
        used of its devices' use."""
        with self._locked():
            return self._write(self._read(), own)

    def claim(self, own: dict[str, Any]) -> int | None:
        """Publish ``own`` only if the other engines leave room for it on each of its devices, in one locked
        step (a vLLM starting beside others takes its memory, or fails its startup check of free memory; a
        wake allocates what it maps back): as ``publish``, or None when there was no room."""
        with self._locked():
            document = self._read()
            share = int(own["used_bytes"]) // len(self._uuids)
            others = _use_per_device(document.get("engines", {}), without=self._engine)
            if any(others.get(uuid, 0) + share > self._total for uuid in self._uuids):
                return None
            return self._write(document, own)

    def _write(self, document: dict[str, Any], own: dict[str, Any]) -> int:
        engines = document.get("engines", {})
        used = int(own["used_bytes"])
        share = used // len(self._uuids)
        engines[self._engine] = {
            **own,
            "gpus": list(self._uuids),
            "total_bytes": self._total * len(self._uuids),
            "devices": [
                {"index": i, "uuid": uuid, "used_bytes": share, "total_bytes": self._total}
                for i, uuid in enumerate(self._uuids)
            ],
        }
        per_device = _use_per_device(engines)
        devices: list[dict[str, Any]] = [
            {"index": index, "uuid": uuid, "used_bytes": per_device[uuid], "total_bytes": self._total}
            for index, uuid in enumerate(sorted(per_device))
        ]
        write_gpu_file(
            self._path,
            {
                "used_bytes": sum(d["used_bytes"] for d in devices),
                "total_bytes": self._total * len(devices),
                "devices": devices,
                "engines": engines,
            },
        )
        return max(per_device[uuid] for uuid in self._uuids)

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


def _use_per_device(engines: dict[str, Any], without: str | None = None) -> dict[str, int]:
    """Each device's use: every engine's use in equal shares on the devices it names (one written before
    devices had names is on GPU-sim-0)."""
    per_device: dict[str, int] = {}
    for name, entry in engines.items():
        uuids = entry.get("gpus") or list(DEFAULT_UUIDS)
        for uuid in uuids:
            per_device.setdefault(uuid, 0)
            if name != without:
                per_device[uuid] += int(entry["used_bytes"]) // len(uuids)
    return per_device
