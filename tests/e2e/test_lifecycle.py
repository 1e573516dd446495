"""Lifecycle calls through the proxy, against the simulator: the rules table, end to end."""

from __future__ import annotations

import asyncio
from typing import Any

from lifeguard_sim.app import SimSettings

SLOW_WAKE = SimSettings(token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.4)
SLOW_SLEEP = SimSettings(token_seconds=0.002, sleep_seconds=0.5, wake_seconds=0.01)


async def post(stack: Any, path: str, **kwargs: Any) -> Any:
    return await stack.client.post(path, **kwargs)


async def test_sleep_is_forwarded_verified_and_answered_with_vllms_body(make_stack: Any) -> None:
    stack = await make_stack()
    resp = await post(stack, "/sleep?level=1")
    assert resp.status == 200
    assert await resp.json() == {"status": "sleeping", "level": 1}
    assert "flags=pass" in resp.headers["X-Lifeguard-Verified"]
    assert "memory=pass" in resp.headers["X-Lifeguard-Verified"]
    state = await stack.state()
    assert (state["state"], state["sleep_level"], state["asleep_tags"]) == ("SLEEPING", 1, ["kv_cache", "weights"])
    assert stack.sim.state_dict()["asleep_tags"] == ["kv_cache", "weights"]


async def test_a_repeated_sleep_is_a_noop_that_never_reaches_vllm(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await post(stack, "/sleep")).status == 200
    sleeps = stack.sim_count("sleep")
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    resp = await post(stack, "/sleep?level=1")
    assert resp.status == 200 and resp.headers["X-Lifeguard-Noop"] == "true"
    assert await resp.json() == {"status": "sleeping", "level": 1}
    assert stack.sim_count("sleep") == sleeps
    assert (await post(stack, "/wake_up")).status == 200
    assert (await held).status == 200  # vLLM's own repeat would have aborted it


async def test_sleep_at_another_level_while_asleep_is_409(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await post(stack, "/sleep?level=1")).status == 200
    resp = await post(stack, "/sleep?level=0")
    assert resp.status == 409
    assert resp.headers["X-Lifeguard-Reason"] == "already_asleep"
    assert (await resp.json())["error"]["type"] == "ConflictError"


async def test_a_request_sent_during_sleep_is_held_by_the_proxy_and_completes_after_wake(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    generated = stack.sim_count("generate")
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert stack.sim_count("generate") == generated  # the engine never saw it
    assert (await post(stack, "/wake_up")).status == 200
    resp = await request
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"]
    assert stack.sim.violations == []


async def test_no_request_is_forwarded_while_the_engine_is_waking(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_WAKE)
    await post(stack, "/sleep")
    wake = asyncio.ensure_future(post(stack, "/wake_up"))
    await stack.wait_state("WAKING")
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert (await wake).status == 200
    assert (await request).status == 200
    assert stack.sim.violations == []


async def test_concurrent_identical_wakes_make_one_upstream_call(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_WAKE)
    await post(stack, "/sleep")
    wakes = stack.sim_count("wake_up")
    answers = await asyncio.gather(*(post(stack, "/wake_up") for _ in range(5)))
    assert [a.status for a in answers] == [200] * 5
    assert {await a.read() for a in answers} == {b'{"status":"awake","tags":null}'}
    assert stack.sim_count("wake_up") == wakes + 1


async def test_a_wake_of_an_awake_engine_is_a_noop_not_forwarded(make_stack: Any) -> None:
    stack = await make_stack()
    wakes = stack.sim_count("wake_up")
    resp = await post(stack, "/wake_up")
    assert resp.status == 200 and resp.headers["X-Lifeguard-Noop"] == "true"
    assert stack.sim_count("wake_up") == wakes


async def test_a_wake_never_silently_lifts_a_user_pause(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await post(stack, "/pause")).status == 200
    assert (await post(stack, "/sleep")).status == 200
    resp = await post(stack, "/wake_up")
    assert resp.status == 200
    assert (await stack.state())["state"] == "PAUSED"
    assert stack.sim.state_dict()["paused"] is True  # vLLM alone would have resumed
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert (await post(stack, "/resume")).status == 200
    assert (await request).status == 200
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_pause_while_asleep_is_recorded_and_applied_on_wake(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    pauses = stack.sim_count("pause")
    resp = await post(stack, "/pause")
    assert resp.status == 200 and stack.sim_count("pause") == pauses
    assert (await stack.state())["paused"] is True
    await post(stack, "/wake_up")
    assert (await stack.state())["state"] == "PAUSED"
    assert stack.sim.state_dict()["paused"] is True


async def test_resume_while_asleep_is_409_and_not_forwarded(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    resumes = stack.sim_count("resume")
    resp = await post(stack, "/resume")
    assert resp.status == 409 and resp.headers["X-Lifeguard-Reason"] == "engine_asleep"
    assert stack.sim_count("resume") == resumes
    assert stack.sim.violations == []


async def test_pause_and_resume_repeat_as_noops(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await post(stack, "/resume")).headers["X-Lifeguard-Noop"] == "true"
    assert (await post(stack, "/pause?mode=keep")).status == 200
    again = await post(stack, "/pause")
    assert again.status == 200 and again.headers["X-Lifeguard-Noop"] == "true"
    assert await again.json() == {"status": "paused"}
    assert (await post(stack, "/resume")).status == 200
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_partial_wake_keeps_holding_until_the_kv_cache_is_awake(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    resp = await post(stack, "/wake_up?tags=weights")
    assert resp.status == 200
    state = await stack.state()
    assert (state["state"], state["asleep_tags"], state["held_requests"]) == ("SLEEPING", ["kv_cache"], 1)
    assert (await post(stack, "/wake_up?tags=weights")).headers["X-Lifeguard-Noop"] == "true"
    assert (await post(stack, "/wake_up?tags=kv_cache")).status == 200
    assert (await request).status == 200
    assert (await stack.state())["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_after_a_level_2_sleep_inference_waits_for_reloaded_weights(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep?level=2")
    await post(stack, "/wake_up?tags=weights")
    await post(stack, "/wake_up?tags=kv_cache")
    state = await stack.state()
    assert state["state"] == "RUNNING" and state["weights_stale"] is True
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    rpc = await post(stack, "/collective_rpc", json={"method": "reload_weights"})
    assert rpc.status == 200
    resp = await request
    assert resp.status == 200
    assert (await stack.state())["weights_stale"] is False
    assert stack.sim.violations == []


async def test_weight_update_session_rules(make_stack: Any) -> None:
    stack = await make_stack()
    assert (await post(stack, "/finish_weight_update")).headers["X-Lifeguard-Reason"] == "no_weight_update_session"
    assert (await post(stack, "/start_weight_update")).status == 200
    assert (await stack.state())["state"] == "UPDATING_WEIGHTS"
    again = await post(stack, "/start_weight_update")
    assert again.status == 409 and again.headers["X-Lifeguard-Reason"] == "weight_update_active"
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    update = await post(stack, "/update_weights", json={"update_info": {}})
    assert update.status == 200
    finish = await post(stack, "/finish_weight_update", json={"weight_version": "v2"})
    assert finish.status == 200
    assert (await request).status == 200
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_weight_update_with_the_weights_asleep_is_409(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    for path in ("/start_weight_update", "/update_weights"):
        resp = await post(stack, path, json={"update_info": {}})
        assert resp.status == 409 and resp.headers["X-Lifeguard-Reason"] == "weights_asleep"
    assert stack.sim.violations == []


async def test_a_different_call_waits_its_turn_and_is_judged_against_the_state_it_finds(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_SLEEP)
    sleep = asyncio.ensure_future(post(stack, "/sleep"))
    await stack.wait_state("FALLING_ASLEEP")
    resume = asyncio.ensure_future(post(stack, "/resume"))
    wake = asyncio.ensure_future(post(stack, "/wake_up"))
    assert (await sleep).status == 200
    assert (await resume).status == 409  # found the engine asleep
    assert (await wake).status == 200  # then woke it
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_call_that_waits_past_its_deadline_is_409_lifecycle_busy(make_stack: Any) -> None:
    stack = await make_stack(sim=SLOW_SLEEP, lifecycle_queue_timeout_s=0.05)
    sleep = asyncio.ensure_future(post(stack, "/sleep"))
    await stack.wait_state("FALLING_ASLEEP")
    resp = await post(stack, "/pause")
    assert resp.status == 409
    assert resp.headers["X-Lifeguard-Reason"] == "lifecycle_busy"
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await sleep).status == 200


async def test_a_failed_wake_is_503_and_rolls_back_to_sleeping_with_requests_still_held(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    stack.faults("wake_up:error500")
    resp = await post(stack, "/wake_up")
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "upstream_error"
    assert "out of memory" in (await resp.json())["error"]["message"]
    state = await stack.state()
    assert (state["state"], state["held_requests"]) == ("SLEEPING", 1)
    assert state["last_error"]["reason"] == "upstream_error"
    assert (await stack.client.get("/lifeguard/healthz")).status == 200
    assert (await post(stack, "/wake_up")).status == 200  # the fault was once: the retry works
    assert (await request).status == 200


async def test_bad_parameters_are_400_and_nothing_is_sent(make_stack: Any) -> None:
    stack = await make_stack()
    before = dict(stack.sim.state_dict()["counters"])  # type: ignore[call-overload]
    for path in ("/sleep?level=7", "/sleep?mode=nope", "/wake_up?tags=gpu", "/pause?mode=x"):
        resp = await post(stack, path)
        assert resp.status == 400, path
        assert resp.headers["X-Lifeguard-Reason"] == "bad_parameter"
        assert (await resp.json())["error"]["param"] in ("query.level", "query.mode", "query.tags")
    assert stack.sim.state_dict()["counters"] == before


async def test_a_streamed_completion_comes_through_as_sse(make_stack: Any) -> None:
    stack = await make_stack()
    resp = await stack.completion(max_tokens=5, stream=True)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    body = await resp.text()
    events = [line for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 6


async def test_a_pause_in_abort_mode_ends_an_in_flight_stream_with_finish_reason_abort(make_stack: Any) -> None:
    stack = await make_stack(sim=SimSettings(token_seconds=0.02, sleep_seconds=0.01, wake_seconds=0.01))
    resp = await stack.completion(max_tokens=400, stream=True)
    await resp.content.readuntil(b"\n\n")
    assert (await post(stack, "/pause?mode=abort")).status == 200
    body = await asyncio.wait_for(resp.text(), 5)
    assert '"finish_reason":"abort"' in body.replace(" ", "")
    assert body.rstrip().endswith("data: [DONE]")


async def test_shutdown_answers_held_requests_503_shutting_down(make_stack: Any) -> None:
    stack = await make_stack()
    await post(stack, "/sleep")
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    closing = asyncio.ensure_future(stack.client.server.close())
    resp = await request
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "shutting_down"
    await closing
