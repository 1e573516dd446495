"""The "200 lies" catalogue (docs/verification.md, items 1-11): each one is caught before the client
sees a 200, inference is never released onto a broken engine, and the proxy ends in the true state.

Every test drives the in-process simulator's faults through the proxy and checks three things: what
the client got, what happened to held inference, and that `/lifeguard/state` agrees with the engine
(`stack.sim`), which also records every breach of engine safety in `violations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import ClientResponse, ClientTimeout

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack


async def _error(resp: ClientResponse) -> dict[str, Any]:
    body: dict[str, Any] = await resp.json()
    assert body["error"]["src"] == "lifeguard", body
    return body["error"]  # type: ignore[no-any-return]


def _failed_check(snapshot: dict[str, Any]) -> dict[str, Any]:
    verification = snapshot["last_verification"]
    assert verification is not None and verification["passed"] is False, verification
    return next(c for c in verification["checks"] if c["result"] == "fail")


async def _asleep(stack: Stack, level: int = 1) -> None:
    resp = await stack.client.post(f"/sleep?level={level}")
    assert resp.status == 200, await resp.text()
    assert stack.sim.state_dict()["sleep_level"] == level


async def _hold_one(stack: Stack) -> asyncio.Task[ClientResponse]:
    task = stack.completion_in_background()
    await stack.wait_held(1)
    return task


async def _still_held(stack: Stack, task: asyncio.Task[ClientResponse], *, generated: int | None = 0) -> None:
    """The held request has neither been answered nor reached the engine (`generated`: the canaries;
    None where the reconcile loop's re-checks run canaries of their own)."""
    snapshot = await stack.state()
    assert snapshot["held_requests"] == 1, snapshot
    assert not task.done()
    if generated is not None:
        assert stack.sim_count("generate") == generated


async def _drop(task: asyncio.Task[ClientResponse]) -> None:
    """The test's own client leaves (the proxy's teardown would otherwise answer it 503)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _assert_sim_asleep(stack: Stack, tags: list[str]) -> None:
    engine = stack.sim.state_dict()
    assert engine["is_sleeping"] is True and engine["asleep_tags"] == tags, engine


# ----- 1. /sleep on an engine started without --enable-sleep-mode
async def test_1_sleep_without_sleep_mode_is_503_memory_and_the_proxy_says_sleeping(make_stack):
    stack = await make_stack(sim=SimSettings(**{**FAST_SIM.__dict__, "sleep_mode": False}))

    resp = await stack.client.post("/sleep?level=1")

    assert resp.status == 503
    error = await _error(resp)
    assert error["reason"] == "verification_failed"
    assert "memory" in error["message"] and "--enable-sleep-mode" in error["message"]
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["sleep_level"] == 1
    _assert_sim_asleep(stack, ["kv_cache", "weights"])  # the flags did flip: vLLM is asleep, just not freed
    check = _failed_check(snapshot)
    assert check["name"] == "memory" and check["value"] == stack.sim.memory.used_bytes
    assert snapshot["sleep_unconfirmed"] is True
    task = await _hold_one(stack)  # still asleep by vLLM's own account: inference is held, not forwarded
    await _still_held(stack, task)
    again = await stack.client.post("/sleep?level=1")  # unconfirmed: sent again, not answered from belief
    assert again.status == 503 and "X-Lifeguard-Noop" not in again.headers
    assert stack.sim_count("sleep") == 2
    await _still_held(stack, task)
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await task).status == 200
    assert stack.sim.violations == []


async def test_1b_lie_memory_on_sleep_flags_asleep_but_nothing_freed_is_503_sleeping(make_stack):
    stack = await make_stack()
    stack.faults("sleep:lie-memory")

    resp = await stack.client.post("/sleep?level=1")

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "verification_failed"
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING"
    assert _failed_check(snapshot)["name"] == "memory"
    _assert_sim_asleep(stack, ["kv_cache", "weights"])
    assert stack.sim.violations == []


async def test_1b_a_sleep_whose_memory_check_outlived_a_restart_of_vllm_adopts_the_awake_engine(make_stack):
    """Chaos seed 7 with checksums on (issue 49): a sleep's memory check polls the GPUs to its deadline, and vLLM died
    and came back awake meanwhile; the flags read before it said asleep, so the proxy held the engine asleep but
    unconfirmed, and answered the next /pause as recorded for the wake (untruthful: vLLM was awake and running)."""
    stack = await make_stack()
    stack.faults("sleep:lie-memory")  # flags asleep, nothing freed: the memory check polls to its deadline
    verifier = stack.engine.verifier
    read_memory = verifier.read_memory

    async def restarted_under_the_memory_check() -> Any:
        reading = await read_memory()
        if stack.sim.is_sleeping:  # the sleep answered, its flags checked: vLLM dies and is back awake
            stack.sim.die("killed while the proxy polled its memory")
            stack.sim.restart()
        return reading

    verifier.read_memory = restarted_under_the_memory_check  # type: ignore[method-assign]
    assert (await stack.client.post("/sleep?level=1")).status == 503
    verifier.read_memory = read_memory  # type: ignore[method-assign]
    assert (await stack.state())["state"] == "RUNNING"
    pause = await stack.client.post("/pause")
    assert pause.status == 200 and "X-Lifeguard-Deferred" not in pause.headers, await pause.text()
    assert stack.sim.is_paused


async def test_1c_a_sleep_from_paused_that_did_nothing_is_sent_again_not_answered_as_a_noop(make_stack):
    # Chaos run (seed 21): from PAUSED the flags already read asleep, so a /sleep that did nothing passed
    # them; the proxy took the engine for asleep and answered the next /sleep as a no-op on a paused engine.
    stack = await make_stack()
    assert (await stack.client.post("/pause")).status == 200
    stack.faults("sleep:lie-asleep")

    resp = await stack.client.post("/sleep?level=1")

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "verification_failed"
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["sleep_unconfirmed"] is True
    engine = stack.sim.state_dict()
    assert engine["paused"] is True and engine["asleep_tags"] == [], engine  # only paused
    assert (await stack.client.post("/resume")).status == 409  # held as asleep: no resume onto maybe-freed memory

    again = await stack.client.post("/sleep?level=1")

    assert again.status == 200, await again.text()
    assert "X-Lifeguard-Noop" not in again.headers
    assert stack.sim_count("sleep") == 2
    _assert_sim_asleep(stack, ["kv_cache", "weights"])
    assert (await stack.state())["sleep_unconfirmed"] is False
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await stack.state())["state"] == "PAUSED"  # the user's pause outlives the sleep
    assert stack.sim.violations == []


# ----- 2. a repeated /sleep: vLLM's repeat aborts what queued while asleep
async def test_2_repeated_sleep_is_a_noop_that_never_reaches_vllm_and_keeps_held_requests(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)

    again = await stack.client.post("/sleep?level=1")

    assert again.status == 200
    assert again.headers["X-Lifeguard-Noop"] == "true"
    assert stack.sim_count("sleep") == 1
    await _still_held(stack, task)
    assert (await stack.client.post("/wake_up")).status == 200
    resp = await task
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["finish_reason"] == "length"  # not aborted
    assert stack.sim.violations == []


# ----- 3. /wake_up with unknown or comma-joined tags: vLLM's silent no-op
async def test_3_unknown_wake_tag_is_400_and_never_sent(make_stack):
    stack = await make_stack()
    await _asleep(stack)

    resp = await stack.client.post("/wake_up?tags=weigths")

    assert resp.status == 400
    error = await _error(resp)
    assert error["reason"] == "bad_parameter" and error["param"] == "query.tags"
    assert stack.sim_count("wake_up") == 0
    assert (await stack.state())["state"] == "SLEEPING"
    _assert_sim_asleep(stack, ["kv_cache", "weights"])


async def test_3_comma_joined_wake_tags_are_sent_as_repeated_params_and_really_wake(make_stack):
    stack = await make_stack()
    await _asleep(stack)

    resp = await stack.client.post("/wake_up?tags=weights,kv_cache")

    assert resp.status == 200
    assert stack.sim.state_dict()["is_sleeping"] is False  # vLLM itself would have ignored "weights,kv_cache"
    assert (await stack.state())["state"] == "RUNNING"
    assert (await stack.completion()).status == 200
    assert stack.sim.violations == []


# ----- 4. a partial wake: 200, yet vLLM still sleeps (and its metric already says awake)
async def test_4_partial_wake_stays_sleeping_and_keeps_requests_held(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)

    resp = await stack.client.post("/wake_up?tags=weights")

    assert resp.status == 200
    assert "flags=pass" in resp.headers["X-Lifeguard-Verified"]
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["asleep_tags"] == ["kv_cache"]
    _assert_sim_asleep(stack, ["kv_cache"])
    await _still_held(stack, task)
    assert (await stack.client.post("/wake_up?tags=kv_cache")).status == 200
    assert (await task).status == 200
    assert (await stack.state())["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_4_a_partial_wake_that_brought_no_memory_back_is_503_and_the_tag_stays_asleep(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:lie-asleep")  # 200, nothing woke; the flags say "sleeping" either way

    resp = await stack.client.post("/wake_up?tags=weights")

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "verification_failed"
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["asleep_tags"] == ["kv_cache", "weights"], snapshot
    assert _failed_check(snapshot)["name"] == "memory"
    await _still_held(stack, task)
    retry = await stack.client.post("/wake_up?tags=weights")  # sent again, and now it really wakes
    assert retry.status == 200 and "X-Lifeguard-Noop" not in retry.headers
    _assert_sim_asleep(stack, ["kv_cache"])
    assert (await stack.client.post("/wake_up?tags=kv_cache")).status == 200
    assert (await task).status == 200
    assert stack.sim.violations == []


# ----- 5. level 2 and a full wake without reload_weights: healthy, but garbage weights
async def test_5_level2_wake_without_reload_holds_inference_until_reload_weights(make_stack):
    stack = await make_stack()
    await _asleep(stack, level=2)
    assert (await stack.client.post("/wake_up")).status == 200
    snapshot = await stack.state()
    assert snapshot["state"] == "RUNNING"
    assert snapshot["weights_stale"] is True and snapshot["weights_stale_reason"] == "discarded"
    assert stack.sim.state_dict()["weights_valid"] is False

    task = await _hold_one(stack)
    await _still_held(stack, task)
    reload = await stack.client.post("/collective_rpc", json={"method": "reload_weights"})

    assert reload.status == 200
    resp = await task
    assert resp.status == 200
    assert "X-Lifeguard-Weights-Stale" not in resp.headers
    assert (await stack.state())["weights_stale"] is False
    assert stack.sim.violations == []  # nothing ran on the discarded weights


async def test_5_level2_documented_order_wake_weights_reload_then_kv_cache_runs_the_canary(make_stack):
    stack = await make_stack()
    await _asleep(stack, level=2)
    task = await _hold_one(stack)

    assert (await stack.client.post("/wake_up?tags=weights")).status == 200
    await _still_held(stack, task)
    assert (await stack.client.post("/collective_rpc", json={"method": "reload_weights"})).status == 200
    await _still_held(stack, task)  # the KV cache still sleeps
    resp = await stack.client.post("/wake_up?tags=kv_cache")

    assert resp.status == 200
    assert "canary=pass" in resp.headers["X-Lifeguard-Verified"]
    assert (await task).status == 200
    snapshot = await stack.state()
    assert snapshot["state"] == "RUNNING" and snapshot["weights_stale"] is False
    assert stack.sim.violations == []


async def test_5_reload_weights_while_the_weights_still_sleep_is_refused(make_stack):
    stack = await make_stack()
    await _asleep(stack, level=2)

    resp = await stack.client.post("/collective_rpc", json={"method": "reload_weights"})

    assert resp.status == 409
    assert (await _error(resp))["reason"] == "weights_asleep"
    assert (await stack.state())["weights_stale"] is True
    assert stack.sim.violations == []


async def test_5_a_level2_sleep_behind_our_back_is_adopted_with_discarded_weights_and_nothing_runs_on_them(
    make_stack, aiohttp_client
):
    stack = await make_stack(hold_timeout_s=30.0)
    await _asleep(stack)
    first = await stack.client.post("/wake_up")
    assert "canary=pass" in first.headers["X-Lifeguard-Verified"]  # the golden answer is recorded
    engine = await aiohttp_client(stack.sim_server)
    assert (await engine.post("/sleep?level=2")).status == 200  # someone calls vLLM directly
    # Adopted as drift; vLLM's engine_sleep_state gauge says discard_all: the weights are gone, as after our own.
    state = await stack.wait_for(lambda s: s["state"] == "SLEEPING" and s["weights_stale"])
    assert state["weights_stale_reason"] == "discarded" and state["sleep_level"] == 2

    resp = await stack.client.post("/wake_up")
    assert resp.status == 200
    assert "canary" not in resp.headers["X-Lifeguard-Verified"]  # a canary would run on discarded weights
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert (await stack.client.post("/collective_rpc", json={"method": "reload_weights"})).status == 200
    assert (await held).status == 200
    assert stack.sim.violations == []


# ----- 6. garbage after a wake (unzeroed pages): only the canary sees it
async def test_6_garbage_after_wake_is_caught_by_the_canary_503_failed(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:garbage")

    resp = await stack.client.post("/wake_up")

    assert resp.status == 503
    error = await _error(resp)
    assert error["reason"] == "verification_failed" and "canary" in error["message"]
    snapshot = await stack.state()
    assert snapshot["state"] == "FAILED"
    check = _failed_check(snapshot)
    assert check["name"] == "canary" and "non-finite" in check["detail"]
    assert stack.sim.state_dict()["garbage"] is True
    refused = await stack.completion()
    assert refused.status == 503 and (await _error(refused))["reason"] == "engine_unavailable"
    # the reconcile loop re-runs the canary: still garbage, so it stays FAILED and releases nothing
    await stack.wait_for(lambda s: stack.sim_count("generate") >= 3)
    assert (await stack.state())["state"] == "FAILED"
    await _still_held(stack, task, generated=None)
    await _drop(task)
    assert stack.sim.violations == []


async def test_6_garbage_that_goes_away_is_noticed_by_the_re_checked_canary_and_traffic_flows_again(
    make_stack, aiohttp_client
):
    stack = await make_stack()
    await _asleep(stack)
    first = await stack.client.post("/wake_up")
    assert "canary=pass" in first.headers["X-Lifeguard-Verified"]  # the golden answer is recorded
    await _asleep(stack)
    stack.faults("wake_up:garbage")
    assert (await stack.client.post("/wake_up")).status == 503
    task = stack.completion_in_background()
    refused = await task
    assert refused.status == 503 and (await _error(refused))["reason"] == "engine_unavailable"

    engine = await aiohttp_client(stack.sim_server)  # the operator reloads the weights on vLLM directly
    assert (await engine.post("/collective_rpc", json={"method": "reload_weights"})).status == 200

    snapshot = await stack.wait_state("RUNNING", timeout=5 * stack.settings.reconcile_interval_s + 1)
    assert snapshot["last_error"]["reason"] == "verification_failed"  # the history is kept
    assert (await stack.completion()).status == 200
    assert stack.sim.violations == []


async def test_6_a_restarted_engine_answering_like_its_checkpoint_is_not_taken_for_garbage(make_stack):
    # Chaos run (seed 202): the golden answer came from trained weights; vLLM restarted with the initial
    # checkpoint, and the first full wake's canary "drifted from golden": FAILED on a healthy engine.
    stack = await make_stack()
    for op in ("start_weight_update", "update_weights", "finish_weight_update"):
        body = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
        assert (await stack.client.post(f"/{op}", json=body if op == "update_weights" else None)).status == 200
    await _asleep(stack)
    trained = await stack.client.post("/wake_up")
    assert "canary=pass" in trained.headers["X-Lifeguard-Verified"]  # golden: the trained weights' answer
    stack.faults("pause:crash")
    assert (await stack.client.post("/pause")).status == 503
    stack.sim.restart()
    assert (await stack.wait_state("RUNNING"))["weights_stale"] is True
    await _asleep(stack)

    resp = await stack.client.post("/wake_up")

    assert resp.status == 200, await resp.text()
    assert "canary=pass" in resp.headers["X-Lifeguard-Verified"]
    assert (await stack.state())["state"] == "RUNNING"
    assert stack.sim.violations == []


# ----- 7. /sleep while decode is in flight, and the engine dies right after its 200
async def test_7_engine_dead_after_sleep_200_is_503_failed_and_held_requests_are_not_released(make_stack):
    stack = await make_stack(sim=SimSettings(**{**FAST_SIM.__dict__, "watchdog_seconds": 0.3}))
    decoding = stack.completion_in_background(max_tokens=500)
    await stack.wait_for(lambda s: s["inflight_requests"] == 1)
    stack.faults("sleep:lie-dead", "sleep:slow:0.3")
    sleep = asyncio.ensure_future(stack.client.post("/sleep?level=1"))
    await stack.wait_state("FALLING_ASLEEP")
    held = await _hold_one(stack)

    resp = await sleep

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "verification_failed"
    snapshot = await stack.state()
    assert snapshot["state"] == "FAILED"
    assert _failed_check(snapshot)["name"] == "health"
    assert stack.sim.state_dict()["dead"] is True
    assert (await decoding).status == 200  # vLLM aborted it (mode=abort): the stream ended, not hung
    refused = await stack.completion()
    assert refused.status == 503 and (await _error(refused))["reason"] == "engine_unavailable"
    await _still_held(stack, held, generated=1)  # never released onto the dead engine
    await stack.wait_for(lambda s: s["state"] == "FAILED" and stack.sim.state_dict()["process_gone"])
    await _drop(held)
    assert stack.sim.violations == []


# ----- 8. engine death mid-call: vLLM never completes the call; /health tells
async def test_8_engine_death_during_a_hung_sleep_is_answered_503_quickly_not_at_the_deadline(make_stack):
    stack = await make_stack(lifecycle_call_timeout_s=60.0)
    stack.faults("sleep:hang")
    call = asyncio.ensure_future(stack.client.post("/sleep?level=1"))
    await stack.wait_for(lambda s: s["state"] == "FALLING_ASLEEP" and stack.sim_count("sleep") == 1)

    stack.sim.errored = True  # the engine core died; the API server lingers with /health 503 (#57853)
    # Answered once /health says so, not at the call's 60 s deadline (nor at the test's own).
    resp = await asyncio.wait_for(call, 20)

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "upstream_unreachable"
    assert (await stack.state())["state"] == "FAILED"
    stack.sim.restart()
    snapshot = await stack.wait_state("RUNNING")
    assert snapshot["weights_stale"] is True and snapshot["weights_stale_reason"] == "restarted"
    served = await stack.completion()
    assert served.status == 200 and served.headers["X-Lifeguard-Weights-Stale"] == "true"
    assert stack.sim.violations == []


async def test_8_engine_crash_mid_wake_is_503_failed_then_back_running_with_stale_weights(make_stack):
    stack = await make_stack(lifecycle_call_timeout_s=60.0)
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:crash")

    resp = await asyncio.wait_for(stack.client.post("/wake_up"), 20)  # not at the call's 60 s deadline

    assert resp.status == 503
    assert (await _error(resp))["reason"] == "upstream_unreachable"
    assert (await stack.state())["state"] == "FAILED"
    await _still_held(stack, task)
    stack.sim.restart()
    snapshot = await stack.wait_state("RUNNING")
    assert snapshot["weights_stale"] is True
    released = await task  # the fresh engine is awake and healthy: the held request may run
    assert released.status == 200 and released.headers["X-Lifeguard-Weights-Stale"] == "true"
    assert stack.sim.violations == []


# ----- 9. a held request whose client gives up
async def test_9_a_held_request_whose_client_leaves_is_dropped_and_never_forwarded(make_stack):
    stack = await make_stack()
    await _asleep(stack)

    async def impatient() -> None:
        async with stack.client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            timeout=ClientTimeout(total=0.3),
        ):
            pass

    gone = asyncio.ensure_future(impatient())
    await stack.wait_held(1)
    try:
        await gone
    except TimeoutError:
        pass
    else:
        raise AssertionError("the held request was answered while the engine slept")
    await stack.wait_held(0)

    assert (await stack.client.post("/wake_up")).status == 200
    assert (await stack.completion()).status == 200
    assert stack.sim_count("generate") == 2  # the wake's canary and the new request: never the one that left
    assert stack.sim.violations == []


# ----- 10. /wake_up OOM: vLLM's 500, and the engine stays asleep (or wedged)
async def test_10_wake_oom_is_503_with_vllms_message_and_rolls_back_to_sleeping(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:error500")

    resp = await stack.client.post("/wake_up")

    assert resp.status == 503
    error = await _error(resp)
    assert "Call to wake_up method failed: CUDA Error: out of memory" in error["message"]
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["asleep_tags"] == ["kv_cache", "weights"]
    _assert_sim_asleep(stack, ["kv_cache", "weights"])
    await _still_held(stack, task)
    assert (await stack.client.get("/lifeguard/healthz")).status == 200
    assert (await stack.client.post("/wake_up")).status == 200  # the OOM was transient
    assert (await task).status == 200
    assert stack.sim.violations == []


async def test_10_wedged_wake_fails_every_time_and_the_proxy_stays_alive_and_asleep(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:wedge")

    for _ in range(2):
        resp = await stack.client.post("/wake_up")
        assert resp.status == 503
        assert "out of memory" in (await _error(resp))["message"]
        assert (await stack.state())["state"] == "SLEEPING"
        await _still_held(stack, task)
    assert stack.sim_count("wake_up") == 2
    assert (await stack.client.get("/lifeguard/healthz")).status == 200
    _assert_sim_asleep(stack, ["kv_cache", "weights"])
    await _drop(task)
    assert stack.sim.violations == []


# ----- 11. DP: /sleep?level=1 then /sleep?level=0 crashed the engine
async def test_11_sleep_at_another_level_while_asleep_is_409_and_never_sent(make_stack):
    stack = await make_stack()
    await _asleep(stack, level=1)

    resp = await stack.client.post("/sleep?level=0")

    assert resp.status == 409
    assert (await _error(resp))["reason"] == "already_asleep"
    assert stack.sim_count("sleep") == 1
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING" and snapshot["sleep_level"] == 1
    assert stack.sim.state_dict()["sleep_level"] == 1
    assert stack.sim.violations == []


# ----- the two lying wakes
async def test_lie_asleep_wake_200_but_still_asleep_is_503_flags_and_stays_sleeping(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:lie-asleep")

    resp = await stack.client.post("/wake_up")

    assert resp.status == 503
    error = await _error(resp)
    assert error["reason"] == "verification_failed" and "/is_sleeping is true" in error["message"]
    snapshot = await stack.state()
    assert snapshot["state"] == "SLEEPING"
    assert _failed_check(snapshot)["name"] == "flags"
    _assert_sim_asleep(stack, ["kv_cache", "weights"])
    await _still_held(stack, task)
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await task).status == 200
    assert stack.sim.violations == []


async def test_lie_memory_wake_flags_awake_but_memory_not_back_is_503_and_nothing_released(make_stack):
    stack = await make_stack()
    await _asleep(stack)
    task = await _hold_one(stack)
    stack.faults("wake_up:lie-memory")

    resp = await stack.client.post("/wake_up")

    assert resp.status == 503
    error = await _error(resp)
    assert error["reason"] == "verification_failed" and "memory" in error["message"]
    snapshot = await stack.state()
    assert snapshot["state"] == "FAILED"
    check = _failed_check(snapshot)
    assert check["name"] == "memory" and check["value"] == stack.sim.memory.used_bytes
    assert stack.sim.state_dict()["is_sleeping"] is False
    await _still_held(stack, task)
    for _ in range(3):  # the re-check finds the memory still missing: FAILED, nothing released
        await stack.engine.coordinator.reconcile()
    assert (await stack.state())["state"] == "FAILED"
    await _still_held(stack, task)
    await _drop(task)
    assert stack.sim.violations == []


# ----- what /lifeguard/state shows
async def test_state_shows_the_last_verification_and_the_gpu_memory_read(make_stack):
    stack = await make_stack()
    awake = stack.sim.memory.used_bytes
    loop = asyncio.get_running_loop()
    sent = loop.time()

    resp = await stack.client.post("/sleep?level=1")
    took = loop.time() - sent

    assert resp.status == 200
    assert resp.headers["X-Lifeguard-Verified"] == "health=pass,flags=pass,memory=pass"
    snapshot = await stack.state()
    verification = snapshot["last_verification"]
    assert verification["passed"] is True and 0 < verification["seconds"] <= took  # the check ran within the call
    checks = {c["name"]: c for c in verification["checks"]}
    assert checks["flags"]["value"] == {"is_sleeping": True, "is_paused": True}
    assert checks["memory"]["value"] == stack.sim.memory.used_bytes < awake
    memory = snapshot["gpu_memory"]
    assert memory["available"] is True
    assert memory["used_bytes"] == stack.sim.memory.used_bytes
    assert memory["devices"][0]["gpu"] == "GPU-sim-0"


async def test_a_caught_lie_is_a_warning_naming_its_check(make_stack, caplog):
    """Was: `lifecycle sleep: verification_failed` at INFO, as quiet as a success."""
    stack = await make_stack()
    stack.faults("sleep:lie-memory")
    caplog.set_level(logging.INFO, logger="lifeguard")
    assert (await stack.client.post("/sleep?level=1")).status == 503
    lines = [r for r in caplog.records if getattr(r, "event", None) == "lifecycle_op" and r.operation == "sleep"]
    assert [(r.levelname, r.lie_check) for r in lines] == [("WARNING", "memory")]
    assert lines[0].getMessage().startswith('lifecycle sleep: a "200 lie" caught by the memory check: vLLM answered')
    assert (await stack.client.post("/wake_up")).status == 200
    ok = [r for r in caplog.records if getattr(r, "event", None) == "lifecycle_op" and r.operation == "wake_up"]
    assert [(r.levelname, r.getMessage()) for r in ok] == [("INFO", "lifecycle wake_up: ok")]
