"""vLLM 0.34's fault tolerance: while its status says the engine is not healthy, vLLM refuses every new request 503
`EngineFaultedError` behind a `/health` 200. The proxy reads the status each reconcile round: while it says so,
inference is held (as vLLM's paused refusal is), `/lifeguard/serving` says 503 `faulted`, and a
`/v1/fault_tolerance/apply` retry that makes the engine healthy lets the held requests go.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack

TOLERANT = SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.34", "enable_fault_tolerance": True})


async def test_a_request_vllm_refuses_as_faulted_is_held_until_the_retry_made_the_engine_healthy(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(TOLERANT)
    stack.faults("generate:engine-fault")
    await (await stack.completion()).read()  # the fault: what ran is aborted, the engine unhealthy
    assert stack.sim.state_dict()["fault_tolerance"]["status"] == "unhealthy"

    rounds = 5 * stack.settings.reconcile_interval_s + 2
    await stack.wait_for(lambda s: s["held_requests"] == 0 and s["state"] == "RUNNING")
    serving = await stack.client.get("/lifeguard/serving")
    for _ in range(int(rounds / 0.02)):
        if serving.status == 503:
            break
        await asyncio.sleep(0.02)
        serving = await stack.client.get("/lifeguard/serving")
    assert serving.status == 503 and (await serving.json())["error"]["cause"] == "faulted"
    held = stack.completion_in_background()
    await stack.wait_held(1)
    assert not held.done()

    body = {"instruction": "retry", "params": {}, "request_id": "r1"}
    assert (await stack.client.post("/v1/fault_tolerance/apply", json=body)).status == 202
    answer = await asyncio.wait_for(held, 5 * stack.settings.reconcile_interval_s + 5)
    assert answer.status == 200, await answer.text()
    assert (await stack.client.get("/lifeguard/serving")).status == 200
