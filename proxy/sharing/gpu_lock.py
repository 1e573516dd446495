"""`GpuLocks`: one memory-taking transition at a time per GPU, in this proxy and across the node's lifeguards.

In this proxy an asyncio lock per device index (FIFO); with `gpu_lock_dir`, also `flock(2)` on
`<gpu_lock_dir>/<GPU UUID>.lock`, released by the kernel when its holder dies, tried without blocking until the
deadline, taken in UUID order (no deadlock). The holder writes who it is, so a waiter's 409 `lifecycle_busy`
names it. One deadline for both: `lifecycle_queue_timeout_s`. docs/gpu-sharing-across-pods.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import GpuLockUnavailable, LifecycleBusy
from ..gpu.readers import GpuMemoryReader, GpuReading

log = logging.getLogger("lifeguard.gpu_lock")

#: How often a GPU another lifeguard holds is tried again: a holder that died frees it at once, so the next
#: waiter has it within this.
POLL_S = 0.02
#: How a transition's wait for its GPUs ended (`lifeguard_gpu_lock_waits_total{outcome}`): taken at once;
#: taken after waiting for another engine here or another lifeguard on the node; refused 409 at the deadline;
#: refused 503 because the node's lock could not be used.
WAIT_OUTCOMES: tuple[str, ...] = ("free", "waited", "busy", "unavailable")

OnWait = Callable[[str, str, float], None]  # (engine, outcome from WAIT_OUTCOMES, seconds waited)


class GpuLockSetupError(Exception):
    """`gpu_lock_dir` cannot work as configured: the proxy does not start (said plainly, exit 1)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU's node lock, as written into its lock file."""

    host: str  # the pod's name on Kubernetes (its hostname)
    pid: int
    engine: str
    op: str
    since: float  # Unix time: comparable across pods

    def describe(self, now: float | None = None) -> str:
        held = (now if now is not None else time.time()) - self.since
        return f"engine {self.engine} ({self.op}) of the lifeguard in {self.host} (pid {self.pid}), for {held:.1f} s"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), int(fields["pid"]), str(fields["engine"]), str(fields["op"]),
                       float(fields["since"]))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None  # empty (free, or its holder has not written yet) or not ours


class LockFile:
    """One GPU's lock file, opened for one attempt to take it; closing the descriptor releases the lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        # Lifeguards of other pods (maybe another user) open it too; only its creator may change the mode.
        with contextlib.suppress(PermissionError):
            os.fchmod(self._fd, 0o666)
        self.held = False

    def try_take(self, holder: Holder) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(holder.as_dict()).encode(), 0)
        return True

    def holder(self) -> Holder | None:
        """Who wrote the file last: the holder, while the lock is held."""
        return Holder.parse(os.pread(self._fd, 4096, 0).decode(errors="replace"))

    def close(self) -> None:
        if self.held:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # free: nobody to name (a holder killed -9 leaves its name; see probe)
        os.close(self._fd)
        self.held = False


def probe(path: Path) -> tuple[bool, Holder | None]:
    """(held, holder) of a lock file, without taking it for longer than a try: the name in a file whose lock
    is free is a dead holder's, and is not reported."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    finally:
        os.close(fd)


class GpuUuids:
    """Each engine GPU index's UUID: from `gpu_devices` where it names one, else from the probe's reading
    (NVML, or the `uuid` of each device in a `file:` probe's file). Learnt once: they do not change."""

    def __init__(self, reader: GpuMemoryReader, configured: tuple[str, ...] = ()) -> None:
        self._reader = reader
        self._configured = configured
        self.known: dict[int, str] = {}

    def learn(self, gpus: Iterable[int], reading: GpuReading) -> list[str]:
        """Take what `reading` says of `gpus`; why each one still has no UUID (empty: all known)."""
        missing = []
        for index in gpus:
            if index in self.known:
                continue
            if index < len(self._configured) and not self._configured[index].isdigit():
                self.known[index] = self._configured[index]
            elif not reading.available:
                missing.append(f"GPU {index}: the probe cannot be read ({reading.unavailable})")
            elif index >= len(reading.devices):
                missing.append(f"GPU {index}: the probe sees {len(reading.devices)} device(s)")
            elif reading.devices[index].uuid is None:
                missing.append(f"GPU {index}: the probe names no UUID for it")
            else:
                self.known[index] = str(reading.devices[index].uuid)
        return missing

    async def of(self, gpus: tuple[int, ...]) -> dict[int, str]:
        if any(index not in self.known for index in gpus):
            missing = self.learn(gpus, await self._reader.read())
            if missing:
                raise GpuLockUnavailable(
                    "the node's GPU lock (gpu_lock_dir) is named by each GPU's UUID, and it is not known: "
                    + "; ".join(missing)
                )
        return {index: self.known[index] for index in gpus}


class NodeLocks:
    """The node's locks: one file per GPU UUID in `directory`, shared by every lifeguard on the node."""

    def __init__(self, directory: Path, uuids: GpuUuids, *, host: str | None = None) -> None:
        self.directory = directory
        self.uuids = uuids
        self.host = host or socket.gethostname()
        self._held: dict[str, Holder] = {}  # by UUID, what this proxy holds now

    async def take(self, engine: str, op: str, gpus: tuple[int, ...], deadline: float) -> tuple[list[LockFile], bool]:
        """Lock files of `gpus`, held, in UUID order, taken before `deadline` (the loop's clock); and whether
        another lifeguard held one meanwhile. Raises 409 `lifecycle_busy` naming the holder at the deadline."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        uuids = sorted(set((await self.uuids.of(gpus)).values()))
        holder = Holder(self.host, os.getpid(), engine, op, time.time())
        taken: list[LockFile] = []
        waited_for: dict[str, list[Holder | None]] = {}  # per GPU, each holder seen in turn while waiting
        try:
            for uuid in uuids:
                lock = self._open(uuid)
                taken.append(lock)
                while not lock.try_take(holder):
                    seen = waited_for.setdefault(uuid, [])
                    other = lock.holder()
                    if not seen or (other is not None and other != seen[-1]):
                        seen.append(other)
                    if loop.time() >= deadline:
                        other = other or seen[-1]
                        raise LifecycleBusy(
                            f"GPU {uuid} stayed locked by another lifeguard on this node for "
                            f"{loop.time() - started:.1f} s (lifecycle_queue_timeout_s): "
                            + (other.describe() if other else "its holder has not written its name yet")
                        )
                    await asyncio.sleep(POLL_S)
                self._held[uuid] = holder
        except BaseException:
            self.release(taken)
            raise
        if waited_for:
            names = "; ".join(
                f"{uuid} by " + ", then ".join(h.describe() if h else "another lifeguard" for h in holders)
                for uuid, holders in waited_for.items()
            )
            log.info(
                "%s of %s waited %.2f s for the node's GPU lock, held by another lifeguard: %s",
                op,
                engine,
                loop.time() - started,
                names,
                extra={
                    "event": "gpu_lock_waited",
                    "engine": engine,
                    "operation": op,
                    "holders": [h.host for holders in waited_for.values() for h in holders if h],
                },
            )
        return taken, bool(waited_for)

    def release(self, taken: list[LockFile]) -> None:
        for lock in reversed(taken):
            self._held.pop(lock.path.name.removesuffix(".lock"), None)
            lock.close()

    def _open(self, uuid: str) -> LockFile:
        try:
            return LockFile(self.directory / f"{uuid}.lock")
        except OSError as exc:
            raise GpuLockUnavailable(
                f"cannot open the node's lock file of GPU {uuid} in {self.directory}: {exc.strerror or exc}"
            ) from None

    async def snapshot(self, gpus: Iterable[int]) -> dict[str, Any]:
        """`gpu_lock` of /lifeguard/state: per GPU index its UUID and who holds its node lock, if anyone."""
        indices = tuple(sorted(set(gpus)))
        with contextlib.suppress(GpuLockUnavailable):  # not known yet: shown as such
            await self.uuids.of(indices)
        now = time.time()
        shown: dict[str, Any] = {}
        for index in indices:
            uuid = self.uuids.known.get(index)
            if uuid is None:
                shown[str(index)] = {"uuid": None, "held": None, "holder": None, "held_here": False}
                continue
            mine = self._held.get(uuid)
            held, holder = (True, mine) if mine else probe(self.directory / f"{uuid}.lock")
            shown[str(index)] = {
                "uuid": uuid,
                "held": held,
                "holder": {**holder.as_dict(), "for_s": round(now - holder.since, 3)} if holder else None,
                "held_here": mine is not None,
            }
        return {"dir": str(self.directory), "host": self.host, "gpus": shown}


class GpuLocks:
    """The one place that takes a GPU for a transition: this proxy's lock per device index and, when
    configured, the node's (`NodeLocks`), under one deadline. `on_wait` counts each wait by outcome."""

    def __init__(self, queue_timeout_s: float, node: NodeLocks | None = None, on_wait: OnWait | None = None) -> None:
        self._timeout_s = queue_timeout_s
        self.node = node
        self._on_wait = on_wait or (lambda engine, outcome, seconds: None)
        self._locks: dict[int, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, engine: str, op: str, gpus: tuple[int, ...]) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._timeout_s
        outcome = "free"
        taken: list[asyncio.Lock] = []
        files: list[LockFile] = []
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    for index in sorted(gpus):
                        lock = self._locks.setdefault(index, asyncio.Lock())
                        if lock.locked():
                            outcome = "waited"
                        await lock.acquire()
                        taken.append(lock)
            except TimeoutError:
                self._on_wait(engine, "busy", loop.time() - started)
                raise LifecycleBusy(
                    f"GPU {list(gpus)} stayed busy with other engines' wakes or weight loads for {self._timeout_s:g} s"
                ) from None
            if self.node is not None:
                try:
                    files, contended = await self.node.take(engine, op, gpus, deadline)
                except LifecycleBusy:
                    self._on_wait(engine, "busy", loop.time() - started)
                    raise
                except GpuLockUnavailable:
                    self._on_wait(engine, "unavailable", loop.time() - started)
                    raise
                if contended:
                    outcome = "waited"
            self._on_wait(engine, outcome, loop.time() - started)
            yield
        finally:
            if self.node is not None:
                self.node.release(files)
            for lock in reversed(taken):
                lock.release()


async def open_node_locks(
    directory: str | None, reader: GpuMemoryReader, probe_kind: str, configured: tuple[str, ...], gpus: Iterable[int]
) -> NodeLocks | None:
    """The node's locks for `gpu_lock_dir` (None: not configured), checked at start: a directory that is
    missing or not writable, or GPUs whose UUIDs the probe cannot give, stop the proxy with a plain reason. A
    `file:` probe whose file is not written yet (its writer starts beside the proxy) is only a warning: the
    UUIDs are learnt on the first transition, which is refused 503 `gpu_lock_unavailable` until then."""
    if directory is None:
        return None
    path = Path(directory)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise GpuLockSetupError(
            f"gpu_lock_dir {path} {what}: it must be a directory shared by every lifeguard on the node "
            "(on Kubernetes a hostPath volume, type DirectoryOrCreate)"
        )
    try:
        fd, probe_path = tempfile.mkstemp(prefix=".lifeguard-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe_path)
    except OSError as exc:
        raise GpuLockSetupError(
            f"gpu_lock_dir {path} is not writable by this proxy (uid {os.geteuid()}): {exc.strerror or exc}; "
            "every lifeguard on the node creates and locks files in it"
        ) from None
    uuids = GpuUuids(reader, configured)
    reading = await reader.read()
    missing = uuids.learn(sorted(set(gpus)), reading)
    if missing and (reading.available or not probe_kind.startswith("file:")):
        raise GpuLockSetupError(
            "gpu_lock_dir names each GPU's lock file by the GPU's UUID, and the GPU probe "
            f"({probe_kind}) cannot give it: {'; '.join(missing)}. Use gpu_probe nvml, a file: probe whose file "
            "has each device's uuid (the simulator's --gpu-file, deploy/k8s/base/gpu-reporter.py), or set "
            "gpu_devices to the GPUs' UUIDs"
        )
    if missing:
        log.warning(
            "gpu_lock_dir: the GPUs' UUIDs are not known yet (%s); each wake, weight load and KV release is "
            "refused 503 gpu_lock_unavailable until the probe's file names them",
            "; ".join(missing),
            extra={"event": "gpu_lock_uuids_unknown"},
        )
    locks = NodeLocks(path, uuids)
    log.info(
        "node GPU locks in %s as %s: %s",
        path,
        locks.host,
        ", ".join(f"GPU {i} = {u}" for i, u in sorted(uuids.known.items())) or "UUIDs to be learnt",
        extra={"event": "gpu_lock_ready"},
    )
    return locks
