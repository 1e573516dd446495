"""The soak's own judges (tests/chaos/soak_checks.py): a fit that calls a leak flat, or the noise of the open
connections a leak, makes `make soak` worthless either way."""

from __future__ import annotations

import math
import os
import random

from tests.chaos.soak_checks import MIB, Resources, after_warmup, fd_growth, flat, growth, read_resources, rss_growth


def _series(per_second: float, noise: float, *, seconds: float = 96.0, every: float = 0.25,
            base: float = 30.0, seed: int = 1) -> list[tuple[float, float]]:  # fmt: skip
    rng = random.Random(seed)
    n = int(seconds / every)
    return [(i * every, base + per_second * i * every + rng.uniform(-noise, noise)) for i in range(n)]


def test_a_steady_climb_is_measured_per_hour() -> None:
    fitted = growth(_series(1 / 60, 0.0))  # one a minute
    assert math.isclose(fitted.per_hour, 60.0, rel_tol=1e-9)
    assert fitted.stderr_per_hour < 1e-6


def test_the_open_connections_of_a_healthy_soak_are_not_a_leak() -> None:
    """A two-minute soak's descriptors go up and down by the connections open at the moment (26-33 with eight
    clients): over the 96 s after the warm-up the fit stays well under the bound, seed after seed."""
    for seed in range(20):
        fitted = growth(_series(0.0, 3.5, seed=seed))
        assert flat(fitted, 120.0), (seed, fitted)


def test_one_descriptor_lost_every_ten_seconds_is_caught_under_the_same_noise() -> None:
    fitted = growth(_series(0.1, 3.5))  # 360 an hour
    assert not flat(fitted, 120.0)
    assert 300 < fitted.per_hour < 420


def test_the_first_and_last_samples_alone_do_not_decide() -> None:
    """A flat series whose last sample happens to be high (a burst of connections as the run ended)."""
    points = [(float(t), 30.0) for t in range(100)] + [(100.0, 60.0)]
    first_vs_last = (60 - 30) / 100 * 3600
    assert growth(points).per_hour < first_vs_last / 10


def test_too_few_samples_have_no_trend_and_are_not_flat() -> None:
    for points in ([], [(0.0, 1.0), (1.0, 1.0)], [(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)]):
        fitted = growth(points)
        assert math.isnan(fitted.per_hour)
        assert not flat(fitted, 1e9)


def test_the_warm_up_is_left_out() -> None:
    samples = [Resources(t, int((50 + (5 if t < 10 else 0.01 * t)) * MIB), 30) for t in range(0, 100)]
    assert rss_growth(after_warmup(samples, 10)).per_hour < 40  # 0.01 MiB/s = 36 MiB/h
    assert rss_growth(samples).per_hour < 0  # the warm-up's fall would hide the climb
    assert [s.t for s in after_warmup(samples, 10)][0] == 10
    assert after_warmup([], 10) == []


def test_this_process_read_from_proc() -> None:
    before = read_resources(os.getpid(), 0.0)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
    ballast = bytearray(64 * MIB)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched, so resident
    try:
        after = read_resources(os.getpid(), 1.0)
    finally:
        for fd in held:
            os.close(fd)
    assert after.fds == before.fds + 5
    assert after.rss_bytes - before.rss_bytes >= 60 * MIB
    assert fd_growth([before, after, Resources(2.0, after.rss_bytes, after.fds + 5)]).per_hour > 0
