"""Memory admission for a wake on shared GPUs, as pure functions: does it fit, and if not, who sleeps first.

The arbiter reads the GPUs, asks `plan_room`, acts (one verified sleep), and asks again. What an engine holds is its
`Residency`, not its state (asleep at level 0, paused or partly awake, it keeps its memory); a wake asks only for
what is not resident yet (`wake_need`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..gpu.readers import GpuReading
from ..lifecycle.rules import ALL_SLEEP_TAGS
from ..lifecycle.states import State

GIB = 1 << 30


class Residency(enum.Enum):
    """What an engine holds on its GPUs, and whether a sleep at level 1 or 2 can give it back."""

    AWAKE = "awake"  # RUNNING or PAUSED (or on the way): everything, and a sleep frees it
    ASLEEP_LEVEL_0 = (
        "asleep_level_0"  # only the scheduler sleeps: everything; a wake adds nothing, then a sleep frees it
    )
    CHANGING = "changing"  # waking or in a weight update: everything, until that ends
    PARTLY_AWAKE = "partly_awake"  # some tags woken: those; vLLM's /sleep is a no-op until the rest are awake
    ASLEEP = "asleep"  # level 1 or 2: only what a sleep leaves
    # Asleep by vLLM's flags, but the GPUs showed nothing freed (a sleep that lied): maybe everything. vLLM's
    # /sleep does nothing to an executor that is asleep already: only a wake, then a sleep, would free it.
    ASLEEP_UNCONFIRMED = "asleep_unconfirmed"
    # STARTING or FAILED: a failed vLLM may hold all its memory, a starting one takes it; never put to sleep
    UNKNOWN = "unknown"


def residency(state: State, asleep_tags: frozenset[str], *, unconfirmed: bool = False) -> Residency:
    """`unconfirmed`: asleep by the flags, but its memory is known to be still there (the arbiter: the record's
    `sleep_unconfirmed` and a reading that shows nothing freed)."""
    if state in (State.STARTING, State.FAILED):
        return Residency.UNKNOWN
    if state is State.SLEEPING:
        if asleep_tags == {"scheduling"}:
            return Residency.ASLEEP_LEVEL_0
        if asleep_tags >= ALL_SLEEP_TAGS:
            return Residency.ASLEEP_UNCONFIRMED if unconfirmed else Residency.ASLEEP
        return Residency.PARTLY_AWAKE
    if state in (State.RUNNING, State.PAUSED, State.PAUSING, State.RESUMING, State.FALLING_ASLEEP) and not asleep_tags:
        # A pause, resume or sleep under way: the swap's sleep waits its turn on that engine's lock.
        return Residency.AWAKE
    return Residency.CHANGING


#: Residencies that hold (about) an awake footprint, or an unknown part of it.
HOLDING = frozenset(Residency) - {Residency.ASLEEP}
#: Residencies a sleep at level 1 or 2 frees, without taking more memory first.
SLEEPABLE = frozenset({Residency.AWAKE, Residency.ASLEEP_LEVEL_0})


@dataclass(frozen=True)
class Neighbour:
    """An engine as the planner sees it, at the moment of the plan."""

    name: str
    gpus: tuple[int, ...]
    residency: Residency
    pinned: bool
    busy: bool  # a weight-update session of its own is open, or it already failed to sleep for this plan
    inflight: int
    held: int
    last_used: float  # monotonic time of its last request
    footprint_bytes: int | None
    sleep_level: int = 1  # the level it is put to sleep at (host_memory.py may lower 1 to 2)
    # Why its level-1 sleep may not be made: it would pin more host memory than is available (host_memory.py).
    host_memory_short: str | None = None

    @property
    def holds_memory(self) -> bool:
        return self.residency in HOLDING


def wake_need(
    footprint: int | None,
    asleep_tags: frozenset[str],
    wakes: frozenset[str],
    *,
    awake_bytes: int | None,
    resident: int | None,
) -> int | None:
    """Bytes a wake of the tags `wakes` adds to the GPUs of an engine with `asleep_tags` asleep. From a
    level-0 sleep nothing (every byte stayed). Otherwise what it takes awake (`awake_bytes`) above what it
    holds now (`resident`, its own memory reading): the rest after a partial wake, nothing after a sleep
    that freed nothing. Where either is not known, its whole `footprint` (None: not known either)."""
    if asleep_tags == {"scheduling"} or not wakes:
        return 0
    if awake_bytes is not None and resident is not None:
        return max(awake_bytes - resident, 0)
    return footprint


@dataclass(frozen=True)
class Fits:
    """Wake it: the memory is there (or cannot be known, and nothing else can be put to sleep)."""


@dataclass(frozen=True)
class Evict:
    """Put `victim` to sleep (at `level`) first, then plan again."""

    victim: str
    level: int = 1


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


def eviction_order(gpus: tuple[int, ...], neighbours: Iterable[Neighbour]) -> list[Neighbour]:
    """The engines that may be put to sleep to make room on `gpus`: awake or asleep at level 0, never a pinned
    one nor one in a weight update. Idle ones first, least recently used first; one serving requests is
    drained before its sleep (the arbiter lets it serve its turn first)."""
    shared = set(gpus)
    eligible = [n for n in neighbours if shared & set(n.gpus) and why_it_stays(n) is None]
    return sorted(eligible, key=lambda n: (n.inflight > 0 or n.held > 0, n.last_used, n.name))


def why_it_stays(n: Neighbour) -> str | None:
    """Why `n` may not be put to sleep to make room (None: it may), as the refusal names it."""
    if n.residency not in SLEEPABLE:
        return _STAYS[n.residency]
    if n.pinned:
        return "pinned"
    if n.busy:
        return "in a weight update, or it failed to sleep"
    return n.host_memory_short


_STAYS = {
    Residency.CHANGING: "waking or updating weights",
    Residency.PARTLY_AWAKE: "partly awake (its sleep would free nothing)",
    Residency.ASLEEP_UNCONFIRMED: "asleep, its memory not freed (its sleep would free nothing)",
    Residency.UNKNOWN: "failed or starting",
    Residency.ASLEEP: "asleep",
}


def plan_room(
    gpus: tuple[int, ...],
    need_bytes: int | None,
    free: Mapping[int, int] | None,
    neighbours: Iterable[Neighbour],
) -> Plan:
    """What to do before a wake on `gpus` that adds `need_bytes` (over all its GPUs, `wake_need`; None: not
    known yet). Unknown need or unknown free memory: every engine that may sleep does, first."""
    if need_bytes == 0:
        return Fits()
    neighbours = list(neighbours)
    order = eviction_order(gpus, neighbours)
    if need_bytes is None or free is None:
        if order:
            return Evict(order[0].name, order[0].sleep_level)
        # Nothing can say it fits beside an engine that keeps its memory (awake, asleep at level 0, paused,
        # partly awake, failed): refused rather than woken into an OOM.
        staying = [n for n in neighbours if n.holds_memory and set(gpus) & set(n.gpus)]
        if staying:
            unknown = "its footprint" if need_bytes is None else "the GPUs' free memory"
            return NoRoom(
                f"{unknown} is not known, and on the same GPU {_staying(staying)} keeps its memory and "
                "cannot be put to sleep"
            )
        return Fits()
    per_gpu = need_bytes / len(gpus)
    short = {g: per_gpu - free.get(g, 0) for g in gpus if free.get(g, 0) < per_gpu}
    if not short:
        return Fits()
    worst = max(short, key=lambda g: short[g])
    if not order:
        there = [n for n in neighbours if n.holds_memory and worst in n.gpus]
        return NoRoom(
            f"it needs {_gib(per_gpu)} on GPU {worst}, {_gib(free.get(worst, 0))} is free, and "
            + (f"no engine there may be put to sleep ({_staying(there)})" if there else _OUTSIDE)
        )
    if all(n.footprint_bytes is not None for n in order):
        for g, missing in short.items():
            could_free = sum((n.footprint_bytes or 0) / len(n.gpus) for n in order if g in n.gpus)
            if could_free < missing:
                return NoRoom(
                    f"it needs {_gib(per_gpu)} on GPU {g}, {_gib(free.get(g, 0))} is free, and putting every engine "
                    f"there that may sleep to sleep would free only {_gib(could_free)}"
                )
    return Evict(order[0].name, order[0].sleep_level)


# The device's free memory counts every process on it: what no engine of this proxy holds, another pod's engine
# (or anything else on that GPU) does, and only its own lifeguard, trainer or orchestrator can put it to sleep.
_OUTSIDE = (
    "the rest is memory held outside this proxy (another pod's engine, or another process on that GPU), "
    "which this lifeguard cannot put to sleep"
)


def _staying(neighbours: list[Neighbour]) -> str:
    return ", ".join(f"{n.name} ({why_it_stays(n)})" for n in sorted(neighbours, key=lambda n: n.name))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
