"""vLLM 0.34's process checkpoint guarded like a sleep, end to end against the simulator's 0.34 profile
(docs/verification.md): `/checkpoint/prepare` and `/checkpoint/restore` serialized and verified by the coordinator,
inference held (never vLLM's retryable `engine_paused`) until the restore is verified, the calls vLLM answers 500 on a
prepared engine refused 409, readiness false, and an engine that started prepared held too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack
from tests.lifeguard_testing import ServeLifeguard

V034 = SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.34"})
STARTS_PREPARED = SimSettings(**{**V034.__dict__, "checkpoint_prepare_on_startup": True})


async def _serving(stack: Stack) -> tuple[int, Any]:
    resp = await stack.client.get("/lifeguard/serving")
    return resp.status, await resp.json()


async def test_a_checkpoint_holds_inference_refuses_what_vllm_would_answer_500_and_the_restore_is_verified(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(V034)
    prepared = await stack.client.post("/checkpoint/prepare?mode=abort")
    assert prepared.status == 200, await prepared.text()
    assert await prepared.json() == {"state": "prepared"}
    assert "checkpoint=pass" in prepared.headers["X-Lifeguard-Verified"]
    assert (await stack.state())["state"] == "CHECKPOINTED"
    assert stack.sim.state_dict()["checkpoint"] == {"state": "prepared"}

    status, body = await _serving(stack)
    assert status == 503 and body["error"]["cause"] == "checkpoint"
    held = stack.completion_in_background()
    await stack.wait_held(1)
    for call in ("/sleep?level=1", "/wake_up", "/resume", "/start_weight_update"):
        refused = await stack.client.post(call, json={} if "weight" in call else None)
        assert refused.status == 409, (call, await refused.text())
        error = (await refused.json())["error"]
        assert error["reason"] == "checkpoint_prepared" and "/checkpoint/restore" in error["message"], call
    again = await stack.client.post("/checkpoint/prepare")
    assert (again.status, again.headers.get("X-Lifeguard-Noop")) == (200, "true")
    assert not held.done()

    restored = await stack.client.post("/checkpoint/restore")
    assert restored.status == 200, await restored.text()
    verified = restored.headers["X-Lifeguard-Verified"]
    assert "canary=pass" in verified and "snapshot=pass" in verified, verified
    answer = await asyncio.wait_for(held, 5)
    assert answer.status == 200
    assert (await stack.state())["state"] == "RUNNING"
    assert (await _serving(stack))[0] == 200
    assert stack.sim.state_dict()["violations"] == []


async def test_an_engine_that_started_prepared_is_not_served_from_although_its_health_is_200(make_stack: Any) -> None:
    stack: Stack = await make_stack(STARTS_PREPARED, ready=("CHECKPOINTED",))
    assert (await stack.client.get("/health")).status == 200
    status, body = await _serving(stack)
    assert status == 503 and body["error"]["cause"] == "checkpoint"
    held = stack.completion_in_background()
    await stack.wait_held(1)
    assert stack.sim.state_dict()["counters"].get("generate", 0) == stack.baseline.get("generate", 0)

    restored = await stack.client.post("/checkpoint/restore")
    assert restored.status == 200, await restored.text()
    assert (await asyncio.wait_for(held, 5)).status == 200
    assert stack.sim.state_dict()["violations"] == []


async def test_a_prepare_sent_to_vllm_behind_the_proxys_back_is_adopted_and_held(make_stack: Any) -> None:
    stack: Stack = await make_stack(V034)
    assert await stack.sim.checkpoint_prepare("abort") is None
    await stack.wait_state("CHECKPOINTED", timeout=5 * stack.settings.reconcile_interval_s + 2)
    resp = stack.completion_in_background()
    await stack.wait_held(1)
    assert (await stack.client.post("/checkpoint/restore")).status == 200
    assert (await asyncio.wait_for(resp, 5)).status == 200


async def test_a_wait_mode_prepare_lets_what_runs_finish_before_it_answers_prepared(make_stack: Any) -> None:
    stack: Stack = await make_stack(V034)
    running = stack.completion_in_background(max_tokens=200)
    await stack.wait_for(lambda s: s["inflight_requests"] == 1)
    prepared = await stack.client.post("/checkpoint/prepare?mode=wait")
    assert prepared.status == 200 and await prepared.json() == {"state": "prepared"}
    finished = await asyncio.wait_for(running, 5)
    assert finished.status == 200 and (await finished.json())["usage"]["completion_tokens"] == 200
    assert (await stack.client.post("/checkpoint/restore")).status == 200


async def test_a_failed_prepare_or_restore_puts_the_engine_out_of_service_saying_so(make_stack: Any) -> None:
    stack: Stack = await make_stack(V034)
    stack.faults("checkpoint_prepare:checkpoint-fails")
    failed = await stack.client.post("/checkpoint/prepare")
    assert failed.status == 503
    assert (await failed.json())["error"]["reason"] == "verification_failed"
    snapshot = await stack.state()
    assert (snapshot["state"], snapshot["failure"]) == ("FAILED", "checkpoint")
    refused = await stack.completion()
    assert refused.status == 503 and "checkpoint failed" in (await refused.json())["error"]["message"]

    restarted: Stack = await make_stack(V034)
    assert (await restarted.client.post("/checkpoint/prepare")).status == 200
    restarted.faults("checkpoint_restore:checkpoint-fails")
    restore = await restarted.client.post("/checkpoint/restore")
    assert restore.status >= 500 and restore.status != 500, await restore.text()
    snapshot = await restarted.state()
    assert (snapshot["state"], snapshot["failure"]) == ("FAILED", "checkpoint")


async def test_a_restarted_proxy_adopts_a_prepared_engine_and_holds_until_the_restore(
    make_stack: Any, serve_lifeguard: ServeLifeguard
) -> None:
    stack: Stack = await make_stack(V034)
    assert (await stack.client.post("/checkpoint/prepare")).status == 200
    await stack.client.close()  # the proxy is gone; vLLM stays prepared

    restarted = Stack(await serve_lifeguard(stack.settings), stack.sim_server, stack.settings)
    await restarted.wait_state("CHECKPOINTED", timeout=5 * stack.settings.reconcile_interval_s + 2)
    held = restarted.completion_in_background()
    await restarted.wait_held(1)
    assert (await restarted.client.post("/checkpoint/restore")).status == 200
    assert (await asyncio.wait_for(held, 5)).status == 200
    assert stack.sim.state_dict()["violations"] == []
