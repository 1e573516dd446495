"""Simulated GPU memory and the ``--gpu-file`` the proxy reads where it would read NVML."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

GIB = 1 << 30
# vLLM's sleep tags that own GPU memory; "scheduling" owns none.
MEMORY_TAGS = ("weights", "kv_cache")


class GpuMemory:
    """One device: a fixed overhead plus the weights and KV pool while they are resident."""

    def __init__(self, *, weights_gib: float, kv_gib: float, overhead_gib: float, total_gib: float) -> None:
        self._sizes = {"weights": int(weights_gib * GIB), "kv_cache": int(kv_gib * GIB)}
        self._overhead = int(overhead_gib * GIB)
        self.total_bytes = int(total_gib * GIB)
        self._resident = set(MEMORY_TAGS)

    @property
    def used_bytes(self) -> int:
        return self._overhead + sum(self._sizes[tag] for tag in self._resident)

    @property
    def resident(self) -> frozenset[str]:
        """The memory tags whose memory is mapped (a lie-memory wake leaves an awake tag out)."""
        return frozenset(self._resident)

    def release(self, tags: set[str]) -> bool:
        """Unmap ``tags``; True when anything moved."""
        before = set(self._resident)
        self._resident -= tags
        return before != self._resident

    def restore(self, tags: set[str]) -> bool:
        before = set(self._resident)
        self._resident |= tags & set(MEMORY_TAGS)
        return before != self._resident

    def reset(self) -> None:
        self._resident = set(MEMORY_TAGS)

    def snapshot(self) -> dict[str, object]:
        used, total = self.used_bytes, self.total_bytes
        return {
            "used_bytes": used,
            "total_bytes": total,
            "devices": [{"index": 0, "uuid": "GPU-sim-0", "used_bytes": used, "total_bytes": total}],
        }


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
