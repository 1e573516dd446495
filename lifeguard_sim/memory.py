"""The engine's GPU memory, two ways, and the ``--gpu-file`` the proxy reads where it would read NVML.

``simulated`` (the default) keeps the books: a fixed overhead plus the weights and KV pool while they are
resident, and the host memory a level-1 sleep's CPU backup of the weights takes (``host_bytes``): freed at the wake
until vLLM 0.33, pinned and kept from the first sleep on in 0.34 (``device_allocator/cumem.py``: ``wake_up`` copies
the backup back and keeps it; a discard, as a level-2 sleep's, releases it). ``cuda`` really allocates them on a
CUDA device with torch, so NVML (the proxy's ``nvml`` probe) sees the bytes go at a sleep and come back at a wake:
``scripts/gpu-check.sh`` runs the simulator so on a GPU machine to prove the proxy's physical check.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Set
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

GIB = 1 << 30
MIB = 1 << 20
# vLLM's sleep tags that own GPU memory; "scheduling" owns none.
MEMORY_TAGS = ("weights", "kv_cache")


class MemoryKind(StrEnum):
    SIMULATED = "simulated"
    CUDA = "cuda"


class MemoryUnavailable(RuntimeError):
    """The memory kind asked for cannot be had here (``cuda`` without torch or without a device)."""


class DeviceMemory(Protocol):
    # True when release/restore move real bytes and take real time (run them off the event loop).
    blocking: bool

    @property
    def used_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def resident(self) -> frozenset[str]: ...
    @property
    def host_bytes(self) -> int: ...
    def release(self, tags: Set[str], *, offload: Set[str] = frozenset()) -> bool: ...
    def restore(self, tags: Set[str]) -> bool: ...
    def added_by(self, tags: Set[str]) -> int: ...
    def reset(self) -> None: ...
    def snapshot(self) -> dict[str, object]: ...


def make_memory(
    kind: MemoryKind,
    *,
    weights_gib: float,
    kv_gib: float,
    overhead_gib: float,
    total_gib: float,
    keep_backups: bool = False,
) -> DeviceMemory:
    if kind is MemoryKind.CUDA:
        return CudaMemory(weights_gib=weights_gib, kv_gib=kv_gib, keep_backups=keep_backups)
    return GpuMemory(
        weights_gib=weights_gib,
        kv_gib=kv_gib,
        overhead_gib=overhead_gib,
        total_gib=total_gib,
        keep_backups=keep_backups,
    )


class GpuMemory:
    """Simulated: one device, a fixed overhead plus the weights and KV pool while they are resident."""

    blocking = False

    def __init__(
        self, *, weights_gib: float, kv_gib: float, overhead_gib: float, total_gib: float, keep_backups: bool = False
    ) -> None:
        self._sizes = {"weights": int(weights_gib * GIB), "kv_cache": int(kv_gib * GIB)}
        self._overhead = int(overhead_gib * GIB)
        self.total_bytes = int(total_gib * GIB)
        self._resident = set(MEMORY_TAGS)
        self._keep_backups = keep_backups
        self._backups: set[str] = set()  # tags whose CPU backup is held in host memory

    @property
    def used_bytes(self) -> int:
        return self._overhead + sum(self._sizes[tag] for tag in self._resident)

    @property
    def resident(self) -> frozenset[str]:
        """The memory tags whose memory is mapped (a lie-memory wake leaves an awake tag out)."""
        return frozenset(self._resident)

    @property
    def host_bytes(self) -> int:
        return sum(self._sizes[tag] for tag in self._backups)

    def release(self, tags: Set[str], *, offload: Set[str] = frozenset()) -> bool:
        """Unmap ``tags`` (``offload``: those whose bytes a level-1 sleep keeps in CPU memory); True when
        anything moved. A tag already unmapped keeps its policy (CuMemAllocator.sleep)."""
        moving = set(tags) & self._resident
        self._backups = (self._backups - moving) | (moving & set(offload))
        self._resident -= moving
        return bool(moving)

    def restore(self, tags: Set[str]) -> bool:
        moving = set(tags) & set(MEMORY_TAGS) - self._resident
        self._resident |= moving
        if not self._keep_backups:
            self._backups -= moving
        return bool(moving)

    def added_by(self, tags: Set[str]) -> int:
        """Bytes that restoring ``tags`` would map."""
        return sum(self._sizes[tag] for tag in set(tags) & set(MEMORY_TAGS) - self._resident)

    def reset(self) -> None:
        self._resident = set(MEMORY_TAGS)
        self._backups = set()

    def snapshot(self) -> dict[str, object]:
        used, total = self.used_bytes, self.total_bytes
        return {
            "used_bytes": used,
            "total_bytes": total,
            "host_bytes": self.host_bytes,
            "devices": [{"index": 0, "uuid": "GPU-sim-0", "used_bytes": used, "total_bytes": total}],
        }


class CudaMemory:
    """Real: the weights and the KV pool as uint8 tensors on ``cuda:0``, freed with ``empty_cache()`` so
    NVML sees the bytes go. A level-1 sleep copies the weights to CPU memory and a wake copies them back;
    discarded weights come back as whatever the fresh pages hold (CUDA does not zero them), as in vLLM."""

    blocking = True

    def __init__(
        self, *, weights_gib: float, kv_gib: float, keep_backups: bool = False, device: str = "cuda:0"
    ) -> None:
        try:
            import torch  # only here: the simulated kind never needs torch
        except ImportError as exc:
            raise MemoryUnavailable("memory kind cuda: torch is not installed") from exc
        if not torch.cuda.is_available():
            raise MemoryUnavailable("memory kind cuda: torch sees no CUDA device")
        self._torch: Any = torch
        self._device = torch.device(device)
        self._sizes = {"weights": _whole_mib(weights_gib), "kv_cache": _whole_mib(kv_gib)}
        self._on_device: dict[str, Any] = {}
        self._offloaded: dict[str, Any] = {}
        self._keep_backups = keep_backups
        self.reset()

    @property
    def used_bytes(self) -> int:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return int(total - free)

    @property
    def total_bytes(self) -> int:
        return int(self._torch.cuda.mem_get_info(self._device)[1])

    @property
    def resident(self) -> frozenset[str]:
        return frozenset(self._on_device)

    @property
    def host_bytes(self) -> int:
        return sum(int(backup.numel()) for backup in self._offloaded.values())

    def release(self, tags: Set[str], *, offload: Set[str] = frozenset()) -> bool:
        moving = sorted(set(tags) & set(self._on_device))
        for tag in moving:
            tensor = self._on_device.pop(tag)
            if tag in offload:
                self._offloaded[tag] = tensor.to("cpu")
            else:
                self._offloaded.pop(tag, None)
            del tensor
        if moving:
            self._torch.cuda.synchronize(self._device)
            self._torch.cuda.empty_cache()
        return bool(moving)

    def restore(self, tags: Set[str]) -> bool:
        moving = sorted(set(tags) & set(MEMORY_TAGS) - set(self._on_device))
        for tag in moving:
            tensor = self._torch.empty(self._sizes[tag], dtype=self._torch.uint8, device=self._device)
            backup = self._offloaded.get(tag) if self._keep_backups else self._offloaded.pop(tag, None)
            if backup is not None:
                tensor.copy_(backup)
            self._on_device[tag] = tensor
        self._torch.cuda.synchronize(self._device)
        return bool(moving)

    def added_by(self, tags: Set[str]) -> int:
        return sum(self._sizes[tag] for tag in set(tags) & set(MEMORY_TAGS) - set(self._on_device))

    def reset(self) -> None:
        self._offloaded.clear()
        self.restore(set(MEMORY_TAGS))
        for tensor in self._on_device.values():
            tensor.zero_()  # a fresh start: the memory written, not only mapped
        self._torch.cuda.synchronize(self._device)

    def snapshot(self) -> dict[str, object]:
        used, total = self.used_bytes, self.total_bytes
        uuid = str(getattr(self._torch.cuda.get_device_properties(self._device), "uuid", "GPU-cuda-0"))
        return {
            "used_bytes": used,
            "total_bytes": total,
            "host_bytes": self.host_bytes,
            "devices": [{"index": self._device.index or 0, "uuid": uuid, "used_bytes": used, "total_bytes": total}],
        }


def _whole_mib(gib: float) -> int:
    return max(1, round(gib * 1024)) * MIB


def write_gpu_file(path: Path, snapshot: dict[str, object]) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(snapshot, out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
