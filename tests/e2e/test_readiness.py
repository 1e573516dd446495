"""`GET /lifeguard/serving` end to end: 200 exactly while an inference request sent now is forwarded at once,
else 503 `not_serving` in vLLM's error shape naming the state and the cause; answered from the proxy's own
state (never held, no call to vLLM); the idle auto-sleep and wake-on-request policies keep working beside it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from lifeguard_sim.app import SimSettings

# Each serving check answers within this, whatever the engine does: it is never held.
AT_ONCE = aiohttp.ClientTimeout(total=2)


async def serving(client: Any, path: str = "/lifeguard/serving") -> tuple[int, dict[str, Any], Any]:
    resp = await client.get(path, timeout=AT_ONCE)
    return resp.status, dict(resp.headers), await resp.json()


def cause(body: dict[str, Any]) -> str:
    return str(body["error"]["cause"])


async def test_serving_follows_a_sleep_and_a_wake_and_answers_while_a_request_is_held(make_stack: Any) -> None:
    # Sleep and wake take a second each: long enough to look at the engine while they run.
    stack = await make_stack(sim=SimSettings(sleep_seconds=1.0, wake_seconds=1.0, token_seconds=0.002))
    status, _, body = await serving(stack.client)
    assert (status, body) == (200, {"serving": True, "state": "RUNNING"})

    sleep = asyncio.ensure_future(stack.client.post("/sleep?level=1"))
    await stack.wait_state("FALLING_ASLEEP")
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    status, headers, body = await serving(stack.client)
    assert status == 503 and (body["error"]["state"], cause(body)) == ("FALLING_ASLEEP", "falling_asleep"), body
    assert (await sleep).status == 200

    status, headers, body = await serving(stack.client)
    assert status == 503
    assert headers["X-Lifeguard-Reason"] == "not_serving" and int(headers["Retry-After"]) >= 1
    error = body["error"]
    assert {key: error[key] for key in ("type", "param", "code", "reason", "state", "cause")} == {
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
        "reason": "not_serving",
        "state": "SLEEPING",
        "cause": "asleep",
    }
    assert "level 1" in error["message"] and "held until a wake" in error["message"]

    wake = asyncio.ensure_future(stack.client.post("/wake_up"))
    await stack.wait_state("WAKING")
    status, _, body = await serving(stack.client)
    assert status == 503 and cause(body) == "waking", body
    assert (await wake).status == 200
    assert (await held).status == 200
    assert (await serving(stack.client))[0] == 200


async def test_serving_is_answered_from_the_proxy_s_own_state_not_by_asking_vllm(make_stack: Any) -> None:
    """vLLM dies between two reconcile rounds: the answer is what the proxy knows until its next round."""
    stack = await make_stack(reconcile_interval_s=3600)
    stack.sim.die("test")
    assert (await serving(stack.client))[0] == 200  # would be 503 if it asked vLLM's /health
    await stack.engine.coordinator.reconcile()
    status, _, body = await serving(stack.client)
    assert status == 503 and (body["error"]["state"], cause(body)) == ("FAILED", "failed"), body


async def test_a_paused_engine_and_discarded_weights_are_not_serving(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await stack.client.post("/pause?mode=keep")).status == 200
    status, _, body = await serving(stack.client)
    assert status == 503 and cause(body) == "paused"
    assert (await stack.client.post("/resume")).status == 200
    assert (await serving(stack.client))[0] == 200

    # A level-2 sleep discards the weights: awake again, the engine still holds inference until a reload.
    assert (await stack.client.post("/sleep?level=2")).status == 200
    assert (await stack.client.post("/wake_up")).status == 200
    status, _, body = await serving(stack.client)
    assert status == 503 and (body["error"]["state"], cause(body)) == ("RUNNING", "weights_discarded"), body
    reload = await stack.client.post("/collective_rpc", json={"method": "reload_weights"})
    assert reload.status == 200
    assert (await serving(stack.client))[0] == 200


async def test_idle_auto_sleep_is_not_serving_and_a_request_sent_anyway_wakes_it(make_stack: Any) -> None:
    stack = await make_stack(idle_sleep_after_s=0.3, on_sleeping="wake")
    await stack.wait_state("SLEEPING", timeout=5)
    status, _, body = await serving(stack.client)
    assert status == 503 and cause(body) == "asleep" and "wakes it" in body["error"]["message"], body
    answer = await stack.completion()  # sent to this engine's own address, as a trainer or a stale router would
    assert answer.status == 200
    assert stack.sim_count("wake_up") == 1
    assert (await serving(stack.client))[0] == 200
    assert stack.sim.violations == []


async def test_the_reject_policy_is_not_serving_while_asleep(make_stack: Any) -> None:
    stack = await make_stack(on_sleeping="reject")
    assert (await stack.client.post("/sleep")).status == 200
    status, _, body = await serving(stack.client)
    assert status == 503 and cause(body) == "asleep" and "refused" in body["error"]["message"], body
    refused = await stack.completion()
    assert refused.status == 503 and refused.headers["X-Lifeguard-Reason"] == "engine_sleeping"


async def test_several_engines_serve_while_any_one_does_each_with_its_own_answer(make_engines: Any) -> None:
    stack = await make_engines()  # a awake, b asleep
    status, _, body = await serving(stack.client)
    assert status == 200 and body["serving"] is True
    assert body["engines"]["a"] == {"serving": True, "state": "RUNNING"}
    assert (body["engines"]["b"]["state"], body["engines"]["b"]["cause"]) == ("SLEEPING", "asleep")
    assert (await serving(stack.client, "/engines/a/lifeguard/serving"))[0] == 200
    status, _, body = await serving(stack.client, "/engines/b/lifeguard/serving")
    assert status == 503 and cause(body) == "asleep"

    assert (await stack.client.post("/engines/a/sleep")).status == 200
    status, headers, body = await serving(stack.client)
    assert status == 503 and headers["X-Lifeguard-Reason"] == "not_serving"
    assert body["error"]["message"] == "no engine can serve now: a (asleep), b (asleep)"
    assert {name: e["cause"] for name, e in body["error"]["engines"].items()} == {"a": "asleep", "b": "asleep"}
