"""Host memory in the swap planner's books: what a level-1 sleep pins for its CPU backup of the weights.

vLLM's level-1 sleep copies the weights into a CPU backup (`device_allocator/cumem.py`, `create_cpu_backup`: an
anonymous mapping pinned with `cudaHostRegister`). From vLLM 0.34 on the backup is kept after the wake, reused by the
next level-1 sleep and released only by a discard (a level-2 sleep): host memory stays at about the weights' size per
engine from its first sleep on. Engines swapped on one GPU so pin more than the node has, and the kernel's OOM killer
ends a process (an engine, or the trainer beside it). Before the arbiter puts a neighbour to sleep at level 1 to make
room, what that sleep would pin is set against the host memory available; where it does not fit, the neighbour is put
to sleep at level 2 (`when_host_memory_short: level_2`) or stays awake, and the planner looks elsewhere or refuses with
the reason (docs/model-swap.md, rule 10). Pure but for reading /proc/meminfo.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..lifecycle.vllm_release import at_least

GIB = 1 << 30
MEMINFO = Path("/proc/meminfo")
#: The first vLLM release that keeps a level-1 sleep's backup after the wake.
_KEEPS_BACKUPS = (0, 34)


@dataclass(frozen=True)
class HostEngine:
    """One engine as the host books see it."""

    name: str
    weights_bytes: int | None  # what a level-1 backup of it takes; None: not known
    sleep_level: int  # the level it is put to sleep at to make room (`swap_sleep_level`)
    fallback_to_level_2: bool  # `when_host_memory_short: level_2`
    asleep_at_level_1: bool  # its backup is pinned now
    backup_kept: bool  # awake, its backup kept pinned by vLLM 0.34 after a level-1 sleep of this arbiter's


@dataclass(frozen=True)
class SleepChoice:
    """How a neighbour is put to sleep to make room: at `level`; `short` says why not at level 1 where host memory is
    short (with `level` 1: it may not be put to sleep at all)."""

    level: int
    short: str | None = None


def choices(engines: Iterable[HostEngine], budget_bytes: int | None, meminfo: Path = MEMINFO) -> dict[str, SleepChoice]:
    """Each engine's `SleepChoice`, from the host memory available now: `budget_bytes` less the backups counted as
    pinned, or (no budget) what the kernel says is available, where the pinned backups are already taken."""
    engines = list(engines)
    free = available(engines, budget_bytes, meminfo)
    return {e.name: choose(e, free) for e in engines}


def available(engines: list[HostEngine], budget_bytes: int | None, meminfo: Path = MEMINFO) -> int | None:
    """Host memory a new level-1 backup may take now; None where it cannot be known."""
    return max(budget_bytes - pinned(engines), 0) if budget_bytes is not None else mem_available(meminfo)


def choose(engine: HostEngine, available: int | None) -> SleepChoice:
    pin = 0 if engine.backup_kept else engine.weights_bytes
    if engine.sleep_level != 1 or pin is None or available is None or pin <= available:
        return SleepChoice(engine.sleep_level)
    short = f"its level-1 sleep would pin {_gib(pin)} of host memory, {_gib(available)} is available"
    return SleepChoice(2 if engine.fallback_to_level_2 else 1, short)


def pinned(engines: Iterable[HostEngine]) -> int:
    """Host memory the engines' level-1 backups are counted to hold now (an unknown size counts nothing)."""
    return sum(e.weights_bytes or 0 for e in engines if e.asleep_at_level_1 or e.backup_kept)


def mem_available(path: Path = MEMINFO) -> int | None:
    """The kernel's MemAvailable in bytes; None where it cannot be read (not Linux)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def keeps_backups(version: str | None) -> bool:
    """Whether vLLM `version` keeps a level-1 sleep's backup pinned after the wake (0.34 and later)."""
    return at_least(version, _KEEPS_BACKUPS)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
