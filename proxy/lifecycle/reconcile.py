"""The background loop between calls: re-read vLLM's flags in settled states, and run the idle policy.

It only reports to the coordinator (which skips a round while a lifecycle call holds the lock, so
the two never overlap); it never changes state itself. While the engine is not up it polls faster,
so a vLLM that comes back is noticed within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .coordinator import LifecycleCoordinator
from .policies import Policies
from .states import State

log = logging.getLogger("lifeguard.reconcile")

_FAST_POLL_S = 0.25


async def reconcile_loop(
    coordinator: LifecycleCoordinator, policies: Policies, interval_s: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            await coordinator.reconcile()
            policies.tick(time.monotonic())
        except Exception:  # the loop must outlive any single bad round
            log.exception("reconcile round failed")
        pause = min(interval_s, _FAST_POLL_S) if coordinator.state in (State.STARTING, State.FAILED) else interval_s
        try:
            async with asyncio.timeout(pause):
                await stop.wait()
        except TimeoutError:
            pass


async def stall_loop(coordinator: LifecycleCoordinator, interval_s: float, stop: asyncio.Event) -> None:
    """The stall watch (stall.py) each interval, apart from the reconcile round: a round can wait on vLLM (a LoRA
    adapter's canary), and a stall holds that wait as it holds every request."""
    while not stop.is_set():
        coordinator.look_for_stall()
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass
