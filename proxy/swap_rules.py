"""Memory admission for a wake on shared GPUs, as pure functions (no I/O): does the engine fit, and if not,
which awake engine is put to sleep first.

The arbiter (proxy/arbiter.py) reads the GPUs, asks `plan_room`, acts on the answer (one verified sleep),
reads again and asks again, until the engine fits or nothing more can be put to sleep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .gpu import GpuReading

GIB = 1 << 30


@dataclass(frozen=True)
class Neighbour:
    """An engine as the planner sees it, at the moment of the plan."""

    name: str
    gpus: tuple[int, ...]
    awake: bool  # RUNNING: its memory is taken and a sleep gives it back
    pinned: bool
    busy: bool  # a weight-update session of its own is open, or it already failed to sleep for this plan
    inflight: int
    held: int
    last_used: float  # monotonic time of its last request
    footprint_bytes: int | None


@dataclass(frozen=True)
class Fits:
    """Wake it: the memory is there (or cannot be known, and nothing else can be put to sleep)."""


@dataclass(frozen=True)
class Evict:
    """Put `victim` to sleep first, then plan again."""

    victim: str


@dataclass(frozen=True)
class NoRoom:
    """It cannot fit: answer the held requests 503 insufficient_gpu_memory."""

    why: str


Plan = Fits | Evict | NoRoom


def free_per_gpu(reading: GpuReading, gpus: Iterable[int]) -> dict[int, int] | None:
    """Free bytes of each of `gpus` (indices into the reader's device list); None when the reading cannot say."""
    if not reading.available:
        return None
    free = {}
    for index in gpus:
        if index >= len(reading.devices):
            return None
        device = reading.devices[index]
        free[index] = device.total_bytes - device.used_bytes
    return free


def eviction_order(gpus: tuple[int, ...], neighbours: Iterable[Neighbour], *, may_drain: bool) -> list[Neighbour]:
    """The engines that may be put to sleep to make room on `gpus`, least recently used first. Never a pinned
    one, one in a weight update, one with held requests, nor (unless requests may be drained first)
    one with requests in flight; those with requests in flight come last."""
    shared = set(gpus)
    eligible = [
        n
        for n in neighbours
        if n.awake
        and not n.pinned
        and not n.busy
        and n.held == 0
        and (n.inflight == 0 or may_drain)
        and shared & set(n.gpus)
    ]
    return sorted(eligible, key=lambda n: (n.inflight > 0, n.last_used, n.name))


def plan_room(
    gpus: tuple[int, ...],
    need_bytes: int | None,
    free: Mapping[int, int] | None,
    neighbours: Iterable[Neighbour],
    *,
    may_drain: bool,
) -> Plan:
    """What to do before waking an engine on `gpus` that takes `need_bytes` awake (over all its GPUs; None:
    not known yet). Unknown need or unknown free memory: every engine that may sleep does, first."""
    neighbours = list(neighbours)
    order = eviction_order(gpus, neighbours, may_drain=may_drain)
    if need_bytes is None or free is None:
        if order:
            return Evict(order[0].name)
        # Nothing can say it fits beside an engine that stays awake: refused rather than woken into an OOM.
        staying = sorted(n.name for n in neighbours if n.awake and set(gpus) & set(n.gpus))
        if staying:
            unknown = "its footprint" if need_bytes is None else "the GPUs' free memory"
            return NoRoom(
                f"{unknown} is not known, and {', '.join(staying)} on the same GPU cannot be put to sleep "
                "(pinned, busy or serving)"
            )
        return Fits()
    per_gpu = need_bytes / len(gpus)
    short = {g: per_gpu - free.get(g, 0) for g in gpus if free.get(g, 0) < per_gpu}
    if not short:
        return Fits()
    worst = max(short, key=lambda g: short[g])
    if not order:
        return NoRoom(
            f"it needs {_gib(per_gpu)} on GPU {worst}, {_gib(free.get(worst, 0))} is free, and no engine there "
            "may be put to sleep (pinned, busy or serving)"
        )
    if all(n.footprint_bytes is not None for n in order):
        for g, missing in short.items():
            could_free = sum((n.footprint_bytes or 0) / len(n.gpus) for n in order if g in n.gpus)
            if could_free < missing:
                return NoRoom(
                    f"it needs {_gib(per_gpu)} on GPU {g}, {_gib(free.get(g, 0))} is free, and putting every engine "
                    f"there that may sleep to sleep would free only {_gib(could_free)}"
                )
    return Evict(order[0].name)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
