"""Reading the engine's GPU memory: NVML, the simulator's memory file, or nothing.

NVML calls are blocking C calls, so they run in a worker thread; the library is initialised on first
use. No GPU, no driver or no NVML library is not an error: the reading is "unavailable" with a reason,
and verification reports the physical check as unavailable instead of failing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from .processes import EngineProcesses

log = logging.getLogger("lifeguard.gpu")


@dataclass(frozen=True)
class DeviceMemory:
    gpu: str  # how the probe names it (its index or UUID): the `gpu` label of the memory series
    used_bytes: int
    total_bytes: int
    uuid: str | None = None  # the same in every container; None where the probe cannot say (gpu_lock_dir needs it)


@dataclass(frozen=True)
class GpuReading:
    """One read of every watched GPU; `devices` is empty and `unavailable` says why when it failed."""

    devices: tuple[DeviceMemory, ...] = ()
    unavailable: str | None = None

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def used_bytes(self) -> int:
        return sum(d.used_bytes for d in self.devices)

    @property
    def total_bytes(self) -> int:
        return sum(d.total_bytes for d in self.devices)

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "unavailable_reason": self.unavailable,
            "used_bytes": self.used_bytes,
            "total_bytes": self.total_bytes,
            "devices": [d.__dict__ for d in self.devices],
        }


class GpuMemoryReader(Protocol):
    async def read(self) -> GpuReading: ...


class NoGpuReader:
    async def read(self) -> GpuReading:
        return GpuReading(unavailable="gpu probe disabled (--gpu-probe none)")


class FileReader:
    """Reads the simulator's `--gpu-file` or the k8s GPU reporter's file (`{"used_bytes", "total_bytes",
    "devices"}`). A writer that refreshes periodically adds `updated_at` (epoch seconds); a reading older
    than `max_age_s` is unavailable, because a writer that died would otherwise leave old numbers in use."""

    def __init__(self, path: str | Path, max_age_s: float = 10.0, *, engine: str | None = None) -> None:
        self._path = Path(path)
        self._max_age_s = max_age_s
        self._engine = engine

    async def read(self) -> GpuReading:
        try:
            payload = json.loads(await asyncio.to_thread(self._path.read_text))
            if not isinstance(payload, dict):
                raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
            if self._engine is not None:
                # Several engines share the device: their own use is under "engines" (the simulator writes it).
                updated_at = payload.get("updated_at")
                payload = payload.get("engines", {}).get(self._engine)
                if not isinstance(payload, dict):
                    raise ValueError(f"no memory of engine {self._engine!r} in it")
                payload.setdefault("updated_at", updated_at)
            devices = tuple(
                DeviceMemory(
                    str(d.get("uuid", d.get("index"))),
                    int(d["used_bytes"]),
                    int(d["total_bytes"]),
                    str(d["uuid"]) if d.get("uuid") else None,
                )
                for d in payload.get("devices", [])
            ) or (DeviceMemory("0", int(payload["used_bytes"]), int(payload["total_bytes"])),)
            updated_at = payload.get("updated_at")
            age = time.time() - float(updated_at) if updated_at is not None else 0.0
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return GpuReading(unavailable=f"cannot read {self._path}: {exc}")
        if age > self._max_age_s:
            return GpuReading(unavailable=f"{self._path} is {age:.0f} s old; its writer has stopped")
        return GpuReading(devices=devices)


@dataclass
class NvmlReader:
    """NVML through `nvidia-ml-py` (module `pynvml`). `devices`: indices or UUIDs; empty = all visible.
    `processes`: read one engine's own memory, its processes' on each device (NVML's per-process list), instead
    of the devices' totals: what tells one engine from another on a shared GPU."""

    devices: tuple[str, ...] = ()
    processes: EngineProcesses | None = None
    _handles: list[tuple[str, Any, str]] | None = field(default=None, init=False, repr=False)
    _failed: str | None = field(default=None, init=False, repr=False)
    _initialised: bool = field(default=False, init=False, repr=False)
    _said_unseen: bool = field(default=False, init=False, repr=False)

    async def read(self) -> GpuReading:
        return await asyncio.to_thread(self._read_blocking)

    def _read_blocking(self) -> GpuReading:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            return GpuReading(unavailable=f"nvidia-ml-py is not installed: {exc}")
        if self._failed is not None:
            return GpuReading(unavailable=self._failed)
        pids = self._pids()
        if pids is not None and not pids:
            return GpuReading(unavailable=self._unseen())
        try:
            if not self._initialised:
                pynvml.nvmlInit()  # reference-counted by NVML: once per process is enough
                self._initialised = True
            if self._handles is None:
                self._handles = self._resolve(pynvml)
            if not self._handles:
                self._handles = None  # a GPU may be attached later (device plugin): look again next time
                return GpuReading(unavailable="NVML sees no GPU")
            devices = []
            for name, handle, uuid in self._handles:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                used = int(info.used) if pids is None else _own_bytes(pynvml, handle, pids)
                devices.append(DeviceMemory(name, used, int(info.total), uuid))
        except pynvml.NVMLError as exc:
            reason = f"NVML: {exc}"
            if isinstance(exc, (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded)):
                self._failed = reason  # will not appear later in this process; stop retrying
            else:
                self._handles = None  # e.g. GPU lost: re-resolve next time
            return GpuReading(unavailable=reason)
        return GpuReading(devices=tuple(devices))

    def _pids(self) -> frozenset[int] | None:
        return self.processes.pids() if self.processes is not None else None

    def _unseen(self) -> str:
        assert self.processes is not None
        reason = (
            f"the engine's processes (the one listening on port {self.processes.port} and its children) cannot be "
            "seen from here: share the pod's process namespace (shareProcessNamespace: true)"
        )
        if not self._said_unseen:
            log.warning("per-engine GPU memory unavailable: %s", reason, extra={"event": "engine_processes_unseen"})
            self._said_unseen = True
        return reason

    def _resolve(self, pynvml: Any) -> list[tuple[str, Any, str]]:
        """(name, handle, UUID) of each watched device."""
        if not self.devices:
            named = [(str(i), pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
        else:
            named = [
                (ident, pynvml.nvmlDeviceGetHandleByIndex(int(ident)))
                if ident.isdigit()
                else (ident, pynvml.nvmlDeviceGetHandleByUUID(ident))
                for ident in self.devices
            ]
        return [(name, handle, _text(pynvml.nvmlDeviceGetUUID(handle))) for name, handle in named]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedGpuReader:
    """One engine among several on the same GPUs, where only the device totals can be read: its own use is
    unknown, so its verification reports the memory check unavailable rather than guess."""

    async def read(self) -> GpuReading:
        return GpuReading(unavailable="the GPU is shared by several engines and the probe reads device totals only")


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def make_engine_reader(probe: str, engine: str, upstream: str, devices: tuple[str, ...] = ()) -> GpuMemoryReader:
    """The memory of one engine of several (`engines:`): its own entry in a shared GPU file; with NVML, its own
    processes' memory when it runs on this host (in the pod); else unavailable."""
    if probe.startswith("file:"):
        return FileReader(probe[len("file:") :], engine=engine)
    url = urlsplit(upstream)
    if probe == "nvml" and url.hostname in _LOOPBACK and url.port is not None:
        return NvmlReader(devices, processes=EngineProcesses(url.port))
    if probe == "none":
        return NoGpuReader()
    return SharedGpuReader()


def _own_bytes(pynvml: Any, handle: Any, pids: frozenset[int]) -> int:
    """What `pids` hold on the device, by NVML's per-process list (a value it cannot tell counts nothing)."""
    own = 0
    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if process.pid in pids and isinstance(process.usedGpuMemory, int):
            own += process.usedGpuMemory
    return own


def make_reader(probe: str, devices: tuple[str, ...] = ()) -> GpuMemoryReader:
    """`nvml`, `file:PATH` or `none`, as validated by Settings."""
    if probe == "none":
        return NoGpuReader()
    if probe.startswith("file:"):
        return FileReader(probe[len("file:") :])
    return NvmlReader(devices)
