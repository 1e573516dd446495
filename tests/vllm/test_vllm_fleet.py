"""vllm-router, unmodified, in front of three lifeguards, one of them guarding the session's real vLLM-for-CPU
(the engine that sleeps; its sleep is vLLM's own), the other two simulators serving the same model name.
The same run as `make test-fleet` (tests/fleet/fleet.py): once with vLLM's `/health` as the router's health
check, once with `/lifeguard/serving`; the sleeping engine's lifeguard counts what it held.

Needs vllm-router (scripts/test-vllm.sh installs it with scripts/install-router.sh: LIFEGUARD_ROUTER_BIN)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fleet import fleet as fleet_mod  # `fleet` is the run's Fleet below
from tests.lifeguard_testing import missing
from tests.vllm.conftest import reset_vllm
from tests.vllm.vllm_e2e import metrics, sleep_ops

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

INTERVAL_S = 1
# A real vLLM on a shared CPU core answers in tens of ms: a gentler load than the simulators' run, and a
# sleep long enough that what the router does after its first check dominates.
RUN = {"interval_s": INTERVAL_S, "cycles": 2, "asleep_s": 4.0, "awake_s": 4.0, "rate": 12.0, "call_timeout_s": 120.0}
# The lifeguard in front of vLLM: deadlines for a vLLM on two shared cores (generous, never missing).
LIFEGUARD_ENV = {
    "LIFEGUARD_VERIFY_TIMEOUT_S": "60",
    "LIFEGUARD_CANARY_TIMEOUT_S": "60",
    "LIFEGUARD_HOLD_TIMEOUT_S": "180",
}


@pytest.fixture
async def fleet(vllm_server: Any, tmp_path: Path) -> AsyncIterator[Any]:
    router = os.environ.get("LIFEGUARD_ROUTER_BIN")
    if not router:
        missing("LIFEGUARD_ROUTER_BIN unset: scripts/test-vllm.sh installs vllm-router")
    reset_vllm(vllm_server)
    workdir = Path(os.environ.get("LIFEGUARD_VLLM_LOG_DIR") or tmp_path) / "fleet"
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = fleet_mod.Fleet(workdir, router)
    try:
        fleet.start_pair("vllm", upstream=vllm_server.url, lifeguard_env=LIFEGUARD_ENV)
        fleet.start_pair("sim-b")
        fleet.start_pair("sim-c")
        yield fleet
    finally:
        fleet.stop()
        reset_vllm(vllm_server)


async def test_vllm_router_with_lifeguard_serving_sends_nothing_to_a_sleeping_real_vllm(
    fleet: Any, vllm_server: Any
) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await fleet.wait_running(session, timeout=60)
        sleeps = sleep_ops(await metrics(session, vllm_server.url), "sleep")
        baseline = (await fleet_mod.run_cycles(fleet, session, endpoint="/health", **RUN)).summary()
        serving = (await fleet_mod.run_cycles(fleet, session, endpoint="/lifeguard/serving", **RUN)).summary()
        # vLLM itself slept each time: the sleep is vLLM's own, not the lifeguard's belief.
        assert sleep_ops(await metrics(session, vllm_server.url), "sleep") == sleeps + 2 * RUN["cycles"]
    fleet_mod.write_report(
        [baseline, serving], "vllm-router 0.1.17, a real vLLM-for-CPU + two simulators (make test-vllm)"
    )

    fleet_mod.assert_serving_takes_the_sleeper_out(baseline, serving, INTERVAL_S)
