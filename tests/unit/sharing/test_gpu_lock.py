"""The GPU locks (proxy/sharing/gpu_lock.py): this proxy's per GPU and the node's (`gpu_lock_dir`), on real files with
real `flock(2)`; one lifeguard of the node is a `NodeLocks` here, or a separate process where death matters."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.config import Settings
from proxy.errors import GpuLockUnavailable, LifecycleBusy
from proxy.gpu.readers import DeviceMemory, FileReader, GpuReading, NoGpuReader
from proxy.sharing.gpu_lock import (
    GpuLocks,
    GpuLockSetupError,
    GpuUuids,
    Holder,
    LockFile,
    NodeLocks,
    open_node_locks,
    probe,
)

GIB = 1 << 30


class Reading:
    """A GPU reader that answers what the test says."""

    def __init__(self, reading: GpuReading) -> None:
        self.reading = reading
        self.reads = 0

    async def read(self) -> GpuReading:
        self.reads += 1
        return self.reading


def devices(*uuids: str | None) -> GpuReading:
    return GpuReading(devices=tuple(DeviceMemory(str(i), 0, 80 * GIB, uuid) for i, uuid in enumerate(uuids)))


def lifeguard(directory: Path, host: str, *uuids: str) -> NodeLocks:
    """One lifeguard of the node: its own view of the GPUs (index -> UUID) and the shared directory."""
    return NodeLocks(directory, GpuUuids(Reading(devices(*uuids))), host=host)


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


@pytest.fixture
def refused_tries(monkeypatch: pytest.MonkeyPatch) -> dict[str, asyncio.Event]:
    """Per lock file name, set once a `try_take` of it found it held: a waiter is waiting on it."""
    tried: dict[str, asyncio.Event] = {}
    try_take = LockFile.try_take

    def watched(self: LockFile, holder: Holder) -> bool:
        taken = try_take(self, holder)
        if not taken:
            tried.setdefault(self.path.name, asyncio.Event()).set()
        return taken

    monkeypatch.setattr(LockFile, "try_take", watched)
    return tried


async def waiting_on(tried: dict[str, asyncio.Event], name: str) -> None:
    async with asyncio.timeout(10):
        while name not in tried:
            await asyncio.sleep(0)  # the waiter's first try is due on this loop
        await tried[name].wait()


async def test_a_second_lifeguard_waits_for_the_first_and_is_told_who_holds_the_gpu(tmp_path: Path) -> None:
    first, second = lifeguard(tmp_path, "pod-a", "GPU-x"), lifeguard(tmp_path, "pod-b", "GPU-x")
    held, contended = await first.take("a", "wake_up", (0,), deadline(1))
    assert not contended
    on_disk = Holder.parse((tmp_path / "GPU-x.lock").read_text())
    assert on_disk is not None and (on_disk.host, on_disk.engine, on_disk.op) == ("pod-a", "a", "wake_up")

    gives_up_at = deadline(0.3)
    with pytest.raises(LifecycleBusy) as refused:
        await second.take("b", "wake_up", (0,), gives_up_at)
    assert asyncio.get_running_loop().time() >= gives_up_at  # waited out its deadline, not refused at once
    assert refused.value.status == 409
    assert "GPU GPU-x" in refused.value.message and "engine a (wake_up)" in refused.value.message
    assert "pod-a" in refused.value.message

    first.release(held)
    assert (tmp_path / "GPU-x.lock").read_text() == ""  # free: nobody named
    taken, contended = await second.take("b", "wake_up", (0,), deadline(1))
    assert not contended
    second.release(taken)


async def test_the_wait_ends_when_the_holder_lets_go_and_is_logged_with_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, refused_tries: dict[str, asyncio.Event]
) -> None:
    first, second = lifeguard(tmp_path, "pod-a", "GPU-x"), lifeguard(tmp_path, "pod-b", "GPU-x")
    held, _ = await first.take("a", "collective_rpc", (0,), deadline(1))
    caplog.set_level(logging.INFO, "lifeguard.gpu_lock")
    take = asyncio.create_task(second.take("b", "wake_up", (0,), deadline(30)))
    await waiting_on(refused_tries, "GPU-x.lock")
    assert not take.done()
    first.release(held)
    taken, contended = await asyncio.wait_for(take, 10)  # long before its own deadline: the release ended it
    assert contended
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "gpu_lock_waited"]
    assert "wake_up of b waited" in line.getMessage() and "engine a (collective_rpc)" in line.getMessage()
    assert line.holders == ["pod-a"]  # type: ignore[attr-defined]
    second.release(taken)


async def test_a_holder_killed_9_frees_the_gpu_at_once_and_its_stale_name_is_not_reported(
    tmp_path: Path, refused_tries: dict[str, asyncio.Event]
) -> None:
    """The kernel releases a dead process's flock: no lease to expire. The file still says who held it; a
    probe that finds the lock free does not believe it."""
    lock = tmp_path / "GPU-x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, json, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o666)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, json.dumps({'host': 'pod-dead', 'pid': os.getpid(), 'engine': 'z', 'op': 'wake_up',"
         " 'since': time.time()}).encode())\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        held, named = probe(lock)
        assert held and named is not None and named.host == "pod-dead"
        waiter = lifeguard(tmp_path, "pod-b", "GPU-x")
        take = asyncio.create_task(waiter.take("b", "wake_up", (0,), deadline(30)))
        await waiting_on(refused_tries, "GPU-x.lock")
        assert not take.done()
        os.kill(holder.pid, signal.SIGKILL)
        taken, contended = await asyncio.wait_for(take, 10)  # no lease to expire: the kill alone freed it
        assert contended
        waiter.release(taken)
        assert "pod-dead" in lock.read_text() or lock.read_text() == ""
        assert probe(lock) == (False, None)
    finally:
        holder.kill()
        holder.wait(5)
        assert holder.stdout is not None
        holder.stdout.close()


async def test_several_gpus_are_taken_in_uuid_order_not_index_order(
    tmp_path: Path, refused_tries: dict[str, asyncio.Event]
) -> None:
    """Index 0 is GPU-b and index 1 GPU-a for this lifeguard: it takes GPU-a first, and while it waits for GPU-a
    it holds nothing, so another lifeguard can still take GPU-b (index order would have it hold GPU-b while
    waiting: two pods each taking two GPUs could then deadlock)."""
    holder_a = lifeguard(tmp_path, "pod-1", "GPU-a")
    both = lifeguard(tmp_path, "pod-2", "GPU-b", "GPU-a")
    on_b = lifeguard(tmp_path, "pod-3", "GPU-b")
    held_a, _ = await holder_a.take("one", "wake_up", (0,), deadline(1))
    taking = asyncio.create_task(both.take("two", "wake_up", (0, 1), deadline(30)))
    await waiting_on(refused_tries, "GPU-a.lock")  # it waits for GPU-a
    held_b, contended = await on_b.take("three", "wake_up", (0,), deadline(0.5))
    assert not contended and not taking.done()
    on_b.release(held_b)
    holder_a.release(held_a)
    taken, _ = await asyncio.wait_for(taking, 5)
    assert [lock.path.name for lock in taken] == ["GPU-a.lock", "GPU-b.lock"]
    snapshot = await both.snapshot((0, 1))
    assert snapshot["gpus"]["0"]["uuid"] == "GPU-b" and snapshot["gpus"]["0"]["held_here"] is True
    assert snapshot["gpus"]["1"]["holder"]["engine"] == "two"
    both.release(taken)
    assert (await both.snapshot((0, 1)))["gpus"]["1"] == {
        "uuid": "GPU-a",
        "held": False,
        "holder": None,
        "held_here": False,
    }


async def test_the_state_names_another_lifeguards_hold(tmp_path: Path) -> None:
    mine, theirs = lifeguard(tmp_path, "pod-a", "GPU-x"), lifeguard(tmp_path, "pod-b", "GPU-x")
    before = time.time()
    held, _ = await theirs.take("b", "release_kv_cache_memory", (0,), deadline(1))
    shown = await mine.snapshot((0,))
    held_at_most = time.time() - before
    assert shown["host"] == "pod-a" and shown["dir"] == str(tmp_path)
    gpu = shown["gpus"]["0"]
    assert gpu["held"] is True and gpu["held_here"] is False
    assert (gpu["holder"]["host"], gpu["holder"]["op"]) == ("pod-b", "release_kv_cache_memory")
    assert 0 <= gpu["holder"]["for_s"] <= round(held_at_most, 3) + 0.001  # since it was taken, on the holder's clock
    theirs.release(held)


async def test_one_deadline_covers_this_proxys_lock_and_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[tuple[str, str, float]] = []
    node = lifeguard(tmp_path, "pod-a", "GPU-x")
    other = lifeguard(tmp_path, "pod-b", "GPU-x")
    locks = GpuLocks(0.5, node, on_wait=lambda engine, outcome, s: waits.append((engine, outcome, s)))
    loop = asyncio.get_running_loop()
    async with locks.hold("a", "wake_up", (0,)):
        # Another engine of this proxy waits on this proxy's lock first...
        with pytest.raises(LifecycleBusy, match="stayed busy with other engines"):
            async with locks.hold("a2", "wake_up", (0,)):
                pass
    # ...then a wait on this proxy's lock and one on the node's share one deadline: the node's wait gets what is
    # left of it, not a fresh 0.5 s.
    node_take = node.take
    given: list[tuple[float, float]] = []  # (the deadline node.take got, the loop's time when it was called)

    async def watched_take(*args: object, **kwargs: object) -> object:
        given.append((float(args[3]), loop.time()))  # type: ignore[arg-type]
        return await node_take(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(node, "take", watched_take)
    held, _ = await other.take("b", "wake_up", (0,), deadline(5))
    locks.node = None  # a takes this proxy's lock alone (pod-b holds the node's)
    ours = locks.hold("a", "wake_up", (0,))
    await ours.__aenter__()
    locks.node = node
    queued = asyncio.create_task(locks.hold("a2", "wake_up", (0,)).__aenter__())
    await asyncio.sleep(0)  # one turn: a2 starts its hold (its deadline fixed) and waits for this proxy's lock
    assert not queued.done()
    await asyncio.sleep(0.05)  # a keeps this proxy's lock for 50 ms more of the loop's time while a2 waits
    await ours.__aexit__(None, None, None)  # a lets go: a2 goes on to the node's lock, held by pod-b
    with pytest.raises(LifecycleBusy, match="pod-b"):
        await asyncio.wait_for(queued, 10)
    ((a2_deadline, a2_node_at),) = given
    assert a2_deadline <= a2_node_at + 0.5 - 0.05 + 0.002  # what the wait on this proxy's lock left (uvloop: ms)
    assert loop.time() >= a2_deadline  # refused at that deadline, not before
    other.release(held)
    async with locks.hold("a", "collective_rpc", (0,)):
        assert probe(tmp_path / "GPU-x.lock")[0]
    assert not probe(tmp_path / "GPU-x.lock")[0]
    outcomes = [(engine, outcome) for engine, outcome, _ in waits]
    assert outcomes == [("a", "free"), ("a2", "busy"), ("a", "free"), ("a2", "busy"), ("a", "free")]


async def test_a_gpu_whose_uuid_is_not_known_yet_is_refused_503_and_learnt_once_the_probe_names_it(
    tmp_path: Path,
) -> None:
    reader = Reading(GpuReading(unavailable="cannot read gpu.json: No such file"))
    locks = GpuLocks(1.0, NodeLocks(tmp_path, GpuUuids(reader), host="pod-a"))
    with pytest.raises(GpuLockUnavailable) as refused:
        async with locks.hold("a", "wake_up", (0,)):
            pass
    assert refused.value.status == 503 and "No such file" in refused.value.message
    reader.reading = devices("GPU-x")
    async with locks.hold("a", "wake_up", (0,)):
        assert (tmp_path / "GPU-x.lock").exists()
    reads = reader.reads
    async with locks.hold("a", "wake_up", (0,)):
        pass
    assert reader.reads == reads  # learnt: not read again


def test_uuids_come_from_gpu_devices_where_they_name_one_else_from_the_reading() -> None:
    uuids = GpuUuids(NoGpuReader(), ("GPU-conf-0", "1"))
    assert uuids.learn((0, 1), devices("GPU-read-0", "GPU-read-1")) == []
    assert uuids.known == {0: "GPU-conf-0", 1: "GPU-read-1"}
    missing = GpuUuids(NoGpuReader()).learn((0, 1, 2), devices("GPU-a", None))
    assert missing == ["GPU 1: the probe names no UUID for it", "GPU 2: the probe sees 2 device(s)"]


# ----- at start: said plainly


async def test_a_missing_or_unwritable_lock_directory_stops_the_start(tmp_path: Path) -> None:
    reader = Reading(devices("GPU-x"))
    with pytest.raises(GpuLockSetupError, match="does not exist: it must be a directory shared"):
        await open_node_locks(str(tmp_path / "nope"), reader, "nvml", (), (0,))
    (tmp_path / "file").write_text("")
    with pytest.raises(GpuLockSetupError, match="is not a directory"):
        await open_node_locks(str(tmp_path / "file"), reader, "nvml", (), (0,))
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    # root writes through the mode bits: /proc is a directory nobody can create files in.
    unwritable = "/proc" if os.geteuid() == 0 else str(read_only)
    with pytest.raises(GpuLockSetupError, match="is not writable by this proxy"):
        await open_node_locks(unwritable, reader, "nvml", (), (0,))
    assert await open_node_locks(None, reader, "nvml", (), (0,)) is None


async def test_a_probe_that_cannot_name_the_gpus_stops_the_start(tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpu.json"
    gpu_file.write_text(json.dumps({"devices": [{"index": 0, "used_bytes": 0, "total_bytes": 80 * GIB}]}))
    with pytest.raises(GpuLockSetupError, match=r"file:.*GPU 0: the probe names no UUID for it"):
        await open_node_locks(str(tmp_path), FileReader(gpu_file), f"file:{gpu_file}", (), (0,))
    no_nvml = Reading(GpuReading(unavailable="NVML: NVML Shared Library Not Found"))
    with pytest.raises(GpuLockSetupError, match="Shared Library Not Found.*set gpu_devices to the GPUs' UUIDs"):
        await open_node_locks(str(tmp_path), no_nvml, "nvml", (), (0,))
    # ...unless gpu_devices names them (a machine without NVML, as vLLM-for-CPU's).
    named = await open_node_locks(str(tmp_path), no_nvml, "nvml", ("GPU-cpu-0",), (0,))
    assert named is not None and named.uuids.known == {0: "GPU-cpu-0"}


async def test_a_file_probe_not_written_yet_is_a_warning_not_a_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On Kubernetes the GPU reporter starts in the vLLM container, after the sidecar."""
    gpu_file = tmp_path / "gpu.json"
    node = await open_node_locks(str(tmp_path), FileReader(gpu_file), f"file:{gpu_file}", (), (0,))
    assert node is not None and node.uuids.known == {}
    assert any(getattr(r, "event", None) == "gpu_lock_uuids_unknown" for r in caplog.records)


def test_gpu_lock_dir_with_the_none_probe_and_no_uuids_is_refused_in_the_settings() -> None:
    with pytest.raises(ValidationError, match="gpu_probe none reads no UUID"):
        Settings(upstream="http://127.0.0.1:1", gpu_lock_dir="/run/locks", gpu_probe="none")
    with pytest.raises(ValidationError, match="must be an absolute path"):
        Settings(upstream="http://127.0.0.1:1", gpu_lock_dir="locks")
    ok = Settings(upstream="http://127.0.0.1:1", gpu_lock_dir="/run/locks", gpu_probe="none", gpu_devices="GPU-a")
    assert ok.gpu_lock_dir == "/run/locks" and ok.gpu_devices == ("GPU-a",)
