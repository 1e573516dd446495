"""The soak's own judges (tests/chaos/soak_run.py): the proxy's resources read from /proc, and whether they grow.

A growth is a least-squares slope over every sample after the warm-up, per hour, with its standard error: the
first and last samples alone say more about where the allocator's arenas happened to be than about a leak.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class Resources:
    """One look at a process: when (the run's monotonic clock), its resident memory and its open descriptors."""

    t: float
    rss_bytes: int
    fds: int


def read_resources(pid: int, t: float) -> Resources:
    """The process's VmRSS (/proc/PID/status) and the number of entries in /proc/PID/fd."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
            break
    return Resources(t, rss_kib * 1024, len(os.listdir(f"/proc/{pid}/fd")))


@dataclass(frozen=True)
class Growth:
    """A fitted trend: units per hour, and the standard error of that slope (also per hour)."""

    per_hour: float
    stderr_per_hour: float
    samples: int
    span_s: float


def growth(points: list[tuple[float, float]]) -> Growth:
    """The least-squares slope of (seconds, value) points, per hour. Fewer than three points, or all at one
    moment, have no trend to speak of: NaN, which no bound accepts."""
    n = len(points)
    span = (max(t for t, _ in points) - min(t for t, _ in points)) if points else 0.0
    if n < 3 or span <= 0:
        return Growth(math.nan, math.nan, n, span)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    stt = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / stt
    residuals = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in points)
    stderr = math.sqrt(residuals / (n - 2) / stt)
    return Growth(slope * 3600, stderr * 3600, n, span)


def after_warmup(samples: list[Resources], warmup_s: float) -> list[Resources]:
    """The samples from `warmup_s` after the first on: a fresh process fills its caches and arenas first."""
    if not samples:
        return []
    start = samples[0].t + warmup_s
    return [s for s in samples if s.t >= start]


def rss_growth(samples: list[Resources]) -> Growth:
    """MiB per hour."""
    return growth([(s.t, s.rss_bytes / MIB) for s in samples])


def fd_growth(samples: list[Resources]) -> Growth:
    """Descriptors per hour."""
    return growth([(s.t, float(s.fds)) for s in samples])


def flat(g: Growth, bound_per_hour: float) -> bool:
    """Whether a trend stays under its bound; a trend that could not be fitted is not flat."""
    return not math.isnan(g.per_hour) and g.per_hour <= bound_per_hour
