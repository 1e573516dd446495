"""vllm-router, unmodified, in front of three lifeguard + simulator pairs under steady load, while one engine
sleeps and wakes in cycles through its own lifeguard (tests/fleet/fleet.py says what is counted and how).

With vLLM's `/health` as the router's health check (what routers use today) the sleeping engine keeps its
share of the traffic, and its lifeguard holds it until the wake. With `/lifeguard/serving` the router takes the
engine out at its next check: nothing is held after one health interval, nothing is lost, every answer is 200.
Run by `make test-fleet` (scripts/test-fleet.sh installs vllm-router and names it in LIFEGUARD_ROUTER_BIN)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.fleet.fleet import Fleet, assert_serving_takes_the_sleeper_out, run_cycles, write_report
from tests.lifeguard_testing import missing

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(240)]

INTERVAL_S = 1


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    router = os.environ.get("LIFEGUARD_ROUTER_BIN")
    if not router:
        missing("LIFEGUARD_ROUTER_BIN unset: run `make test-fleet` (installs vllm-router)")
    workdir = Path(os.environ.get("LIFEGUARD_FLEET_LOG_DIR") or tmp_path)
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir, router)
    try:
        for name in ("a", "b", "c"):
            fleet.start_pair(name)
        yield fleet
    finally:
        fleet.stop()


async def test_vllm_router_with_lifeguard_serving_sends_nothing_to_a_sleeping_engine(fleet: Fleet) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await fleet.wait_running(session, timeout=30)
        baseline = (await run_cycles(fleet, session, endpoint="/health", interval_s=INTERVAL_S)).summary()
        serving = (await run_cycles(fleet, session, endpoint="/lifeguard/serving", interval_s=INTERVAL_S)).summary()
    write_report([baseline, serving], "vllm-router 0.1.17, three lifeguard + simulator pairs (make test-fleet)")

    assert_serving_takes_the_sleeper_out(baseline, serving, INTERVAL_S)
    assert serving["holds"] < baseline["holds"], (serving, baseline)
