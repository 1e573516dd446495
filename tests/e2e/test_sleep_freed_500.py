"""A `/sleep` that answers 500 after its memory was freed (vLLM's `Worker.sleep` assertion, tripped by a neighbour
allocating on a shared GPU; 0.33 and 0.34 alike) is completed by sending it again, as AIBrix 0.8.0 does, instead of
being rolled back to a pause whose `/wake_up` vLLM answers as a no-op (docs/verification.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack

V034 = SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.34"})


async def test_a_sleep_that_answered_500_after_freeing_its_memory_is_sent_again_and_the_wake_maps_it_back(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(V034)
    stack.faults("sleep:freed-500")
    slept = await stack.client.post("/sleep?level=1")
    assert slept.status == 200, await slept.text()
    assert "memory=pass" in slept.headers["X-Lifeguard-Verified"]
    assert stack.sim_count("sleep") == 2
    assert stack.sim.state_dict()["sleep_unrecorded"] == []
    assert (await stack.state())["state"] == "SLEEPING"

    woke = await stack.client.post("/wake_up")
    assert woke.status == 200, await woke.text()
    answer = await asyncio.wait_for(stack.completion(), 5)
    assert answer.status == 200
    assert stack.sim.state_dict()["violations"] == []


async def test_a_sleep_500_that_freed_nothing_is_not_sent_again_and_vllms_state_is_kept(make_stack: Any) -> None:
    stack: Stack = await make_stack(V034)
    stack.faults("sleep:error500")
    failed = await stack.client.post("/sleep?level=1")
    assert failed.status != 200
    assert stack.sim_count("sleep") == 1
    assert (await stack.state())["state"] == "RUNNING"
    assert (await stack.completion()).status == 200
