"""Operating policies: wake on request, idle auto-sleep, drain before sleep, reject while asleep."""

from __future__ import annotations

import asyncio
from typing import Any

from lifeguard_sim.app import SimSettings

SLOW_TOKENS = SimSettings(token_seconds=0.01, sleep_seconds=0.01, wake_seconds=0.05)


async def test_wake_on_request_wakes_once_for_many_requests_and_answers_them(make_stack: Any) -> None:
    stack = await make_stack(on_sleeping="wake")
    assert (await stack.client.post("/sleep")).status == 200
    wakes = stack.sim_count("wake_up")
    answers = await asyncio.gather(*(stack.completion() for _ in range(8)))
    assert [a.status for a in answers] == [200] * 8
    assert stack.sim_count("wake_up") == wakes + 1
    state = await stack.state()
    assert state["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_wake_on_request_never_wakes_onto_discarded_weights(make_stack: Any) -> None:
    stack = await make_stack(on_sleeping="wake", hold_timeout_s=0.3)
    assert (await stack.client.post("/sleep?level=2")).status == 200
    wakes = stack.sim_count("wake_up")
    resp = await stack.completion()
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "hold_timeout"
    assert (await stack.state())["state"] == "SLEEPING"
    assert stack.sim_count("wake_up") == wakes and stack.sim_count("generate") == 0  # no wake, nothing generated
    assert stack.sim.violations == []


async def test_reject_policy_answers_503_engine_sleeping_at_once(make_stack: Any) -> None:
    stack = await make_stack(on_sleeping="reject")
    await stack.client.post("/sleep")
    resp = await stack.completion()
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "engine_sleeping"
    assert int(resp.headers["Retry-After"]) >= 1
    await stack.client.post("/wake_up")
    assert (await stack.completion()).status == 200


async def test_idle_auto_sleep_puts_an_idle_engine_to_sleep_through_the_verified_path(make_stack: Any) -> None:
    stack = await make_stack(idle_sleep_after_s=0.3, idle_sleep_level=1)
    state = await stack.wait_state("SLEEPING", timeout=5)
    assert state["sleep_level"] == 1
    assert stack.sim.state_dict()["asleep_tags"] == ["kv_cache", "weights"]
    checks = {c["name"]: c["result"] for c in state["last_verification"]["checks"]}
    assert checks == {"health": "pass", "flags": "pass", "memory": "pass"}


async def test_idle_auto_sleep_with_wake_on_request_serves_the_next_request(make_stack: Any) -> None:
    stack = await make_stack(idle_sleep_after_s=0.3, on_sleeping="wake")
    await stack.wait_state("SLEEPING", timeout=5)
    resp = await stack.completion()
    assert resp.status == 200
    assert stack.sim.violations == []


async def test_drain_before_sleep_lets_in_flight_requests_finish(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_TOKENS, drain_before_sleep_s=5)
    stream = await stack.completion(max_tokens=30, stream=True)
    await stream.content.readuntil(b"\n\n")
    sleep = await stack.client.post("/sleep?level=1")
    assert sleep.status == 200
    assert sleep.headers["X-Lifeguard-Drained"] == "complete"
    body = await stream.text()
    assert '"finish_reason":"length"' in body.replace(" ", "")  # not "abort"


async def test_without_drain_an_abort_mode_sleep_aborts_in_flight_requests(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_TOKENS)
    stream = await stack.completion(max_tokens=300, stream=True)
    await stream.content.readuntil(b"\n\n")
    assert (await stack.client.post("/sleep?level=1")).status == 200
    body = await stream.text()
    assert '"finish_reason":"abort"' in body.replace(" ", "")


async def test_policies_show_in_the_state(make_stack: Any) -> None:
    stack = await make_stack(on_sleeping="wake", idle_sleep_after_s=60, drain_before_sleep_s=2)
    policies = (await stack.state())["policies"]
    assert policies == {
        "on_sleeping": "wake",
        "idle_sleep_after_s": 60,
        "idle_sleep_level": 1,
        "drain_before_sleep_s": 2,
        "stall_after_s": None,
    }
