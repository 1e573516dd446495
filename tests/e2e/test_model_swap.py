"""Several engines on one simulated GPU behind one proxy (docs/model-swap.md): swaps by model name, the
least recently used engine put to sleep, pinned engines, one wake at a time per GPU, out-of-memory wakes and
engines dying mid-swap. Assertions are on the simulators' own books (counters, memory, violations), never on
timing; every wait has a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from lifeguard_sim.engine import Engine
from proxy.lifecycle.outcome import Outcome
from proxy.lifecycle.parsed_calls import LifecycleCall
from tests.e2e.conftest import GIB, MEDIUM, EnginesStack, held_until

MakeEngines = Callable[..., Awaitable[EnginesStack]]
TOTAL = 80 * GIB


async def test_a_request_for_a_sleeping_model_swaps_it_in(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["model"] == "model-b"
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert (stack.sim_count("a", "sleep"), stack.sim_count("b", "wake_up")) == (1, 1)
    assert stack.sim(a := "a").is_sleeping and not stack.sim("b").is_sleeping, a
    assert stack.device_used() <= TOTAL
    # b had no footprint_gib: measured on its first verified wake as what it added to the GPU (2 -> 50 GiB).
    assert (await stack.state())["footprint_bytes"]["b"] == 48 * GIB
    # And back: the other model's request swaps again, each sleep and wake verified.
    resp = await stack.completion("model-a")
    assert resp.status == 200
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    assert stack.violations() == {}
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_swaps_total{engine="b",outcome="ok"} 1.0' in metrics
    assert 'lifeguard_swaps_total{engine="a",outcome="ok"} 1.0' in metrics
    assert 'lifeguard_state{engine="a",lifeguard_state="RUNNING"} 1.0' in metrics
    families = {family.name for family in text_string_to_metric_families(metrics)}  # one family per name
    assert {"lifeguard_swaps", "lifeguard_swap_duration_seconds", "lifeguard_state"} <= families


async def test_the_least_recently_used_engine_is_the_one_put_to_sleep(make_engines: MakeEngines) -> None:
    footprint = {"footprint_gib": 38}
    stack = await make_engines(("a", "b", "c"), asleep=("c",), sizes=MEDIUM, engine={n: footprint for n in "abc"})
    assert (await stack.completion("model-b")).status == 200
    assert (await stack.completion("model-a")).status == 200  # a is now the most recently used
    assert (await stack.completion("model-c")).status == 200
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING", "c": "RUNNING"}
    assert stack.sim_count("a", "sleep") == 0
    state = await stack.state()
    assert sorted(state["gpus"]["0"]["awake"]) == ["a", "c"]
    assert state["gpus"]["0"]["engines"] == ["a", "b", "c"]
    assert state["footprint_bytes"] == {"a": 38 * GIB, "b": 38 * GIB, "c": 38 * GIB}
    assert stack.violations() == {}


async def test_a_pinned_engine_is_never_put_to_sleep_and_nothing_is_woken_into_an_oom(
    make_engines: MakeEngines,
) -> None:
    stack = await make_engines(engine={"a": {"pinned": True}, "b": {"footprint_gib": 50}})
    resp = await stack.completion("model-b")
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert int(resp.headers["Retry-After"]) >= 1
    body = await resp.json()
    assert body["error"]["reason"] == "insufficient_gpu_memory" and "pinned" in body["error"]["message"]
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    assert (stack.sim_count("a", "sleep"), stack.sim_count("b", "wake_up")) == (0, 0)
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_swaps_total{engine="b",outcome="no_room"} 1.0' in metrics


async def test_two_sleeping_models_requested_at_once_wake_one_at_a_time(make_engines: MakeEngines) -> None:
    stack = await make_engines(asleep=("a", "b"), drain_before_sleep_s=5.0)
    active: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    for name in ("a", "b"):
        _journal_wakes(stack.sim(name), name, active, overlaps)
    first, second = await asyncio.gather(stack.completion("model-a"), stack.completion("model-b"))
    assert (first.status, second.status) == (200, 200), (await first.text(), await second.text())
    assert overlaps == []  # never two wakes on the GPU at once
    assert stack.sim_count("a", "wake_up") + stack.sim_count("b", "wake_up") == 2
    states = await stack.states()
    assert sorted(states.values()) == ["RUNNING", "SLEEPING"]  # never two awake that do not fit
    assert stack.device_used() <= TOTAL
    assert stack.violations() == {}


def _journal_wakes(engine: Engine, name: str, active: list[str], overlaps: list[tuple[str, ...]]) -> None:
    """Record, in the simulator itself, every wake that starts while another engine's wake runs."""
    original = engine.wake_up

    async def journalled(tags: list[str] | None) -> dict[str, object]:
        if active:
            overlaps.append((*active, name))
        active.append(name)
        try:
            return await original(tags)
        finally:
            active.remove(name)

    engine.wake_up = journalled  # type: ignore[method-assign]


async def test_a_wake_that_runs_out_of_memory_leaves_the_engine_asleep_and_answers_held_requests(
    make_engines: MakeEngines,
) -> None:
    # The configured footprint is a lie (10 GiB; it takes 50): admission lets the wake through, vLLM runs out.
    stack = await make_engines(engine={"a": {"pinned": True}, "b": {"footprint_gib": 10}})
    resp = await stack.completion("model-b")
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 1
    assert stack.sim("b").is_sleeping and not stack.sim("a").is_sleeping
    assert stack.device_used() <= TOTAL
    await stack.wait_for(lambda s: s["engines"]["b"]["state"] == "SLEEPING" and not s["engines"]["b"]["lifecycle_busy"])
    assert (await stack.states())["a"] == "RUNNING"
    assert stack.violations() == {}


async def test_an_engine_that_dies_while_put_to_sleep_never_leaves_two_awake(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    stack.sim("a").set_faults(["sleep:crash"])
    resp = await stack.completion("model-b")
    # a died during its sleep: its memory is still taken, so b is not woken into an OOM; the held request
    # ends with a reason, it is never lost.
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 0
    assert stack.device_used() <= TOTAL
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "FAILED")
    assert (await stack.states())["b"] == "SLEEPING"


async def test_an_engine_that_dies_while_waking_ends_its_held_requests_with_a_reason(
    make_engines: MakeEngines,
) -> None:
    stack = await make_engines(hold_timeout_s=2.0)
    stack.sim("b").set_faults(["wake_up:crash"])
    resp = await stack.completion("model-b")
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] in ("hold_timeout", "engine_unavailable")
    assert await stack.states() == {"a": "SLEEPING", "b": "FAILED"}  # room was made; b never came up
    assert stack.device_used() <= TOTAL
    stack.sim("b").restart()  # a restarted vLLM is awake again: adopted, and it fits beside a sleeping a
    await stack.wait_for(lambda s: s["engines"]["b"]["state"] == "RUNNING")
    assert (await stack.completion("model-b")).status == 200


async def test_a_trainers_wake_on_one_engines_base_url_goes_through_the_arbiter(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.client.post("/engines/b/wake_up")
    assert resp.status == 200, await resp.text()
    assert "flags=pass" in resp.headers["X-Lifeguard-Verified"]
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.sim_count("a", "sleep") == 1
    assert stack.violations() == {}


async def test_swap_sleep_level_2_reloads_the_weights_after_the_wake(make_engines: MakeEngines) -> None:
    stack = await make_engines(engine={"a": {"swap_sleep_level": 2}})
    resets = stack.sim_count("a", "reset_prefix_cache")  # the start-up round's
    assert (await stack.completion("model-b")).status == 200
    assert stack.sim("a").sleep_level == 2 and not stack.sim("a").weights_valid
    resp = await stack.completion("model-a")
    assert resp.status == 200, await resp.text()
    assert stack.sim("a").weights_valid
    assert (stack.sim_count("a", "collective_rpc"), stack.sim_count("a", "reset_prefix_cache") - resets) == (1, 1)
    state: dict[str, Any] = (await stack.state())["engines"]["a"]
    assert state["state"] == "RUNNING" and not state["weights_stale"]
    assert stack.violations() == {}


async def test_a_weight_load_waits_for_a_wake_on_the_same_gpu_and_shows_in_the_swap_queue(
    make_engines: MakeEngines,
) -> None:
    footprint = {"footprint_gib": 38}
    stack = await make_engines(sizes=MEDIUM, engine={"a": footprint, "b": footprint})  # both fit awake
    release = asyncio.Event()
    running: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    b, a = stack.sim("b"), stack.sim("a")
    original_wake, original_rpc = b.wake_up, a.collective_rpc

    async def held_wake(tags: list[str] | None) -> dict[str, object]:
        running.append("wake:b")
        try:
            await asyncio.wait_for(release.wait(), 10)
            return await original_wake(tags)
        finally:
            running.remove("wake:b")

    async def journalled_rpc(method: str, kwargs: dict[str, object] | None = None) -> dict[str, object] | None:
        if running:
            overlaps.append((*running, "rpc:a"))
        return await original_rpc(method, kwargs)

    b.wake_up = held_wake  # type: ignore[method-assign]
    a.collective_rpc = journalled_rpc  # type: ignore[method-assign]
    wake = asyncio.ensure_future(stack.client.post("/engines/b/wake_up"))
    await stack.wait_for(lambda s: any(t["engine"] == "b" and t["running"] for t in s["swap_queue"]))
    rpc = asyncio.ensure_future(stack.client.post("/engines/a/collective_rpc", json={"method": "reload_weights"}))
    queued = await stack.wait_for(lambda s: any(t["engine"] == "a" and not t["running"] for t in s["swap_queue"]))
    assert [(t["engine"], t["op"], t["running"]) for t in queued["swap_queue"]] == [
        ("b", "wake_up", True),
        ("a", "collective_rpc", False),
    ]
    release.set()
    assert (await wake).status == 200
    assert (await rpc).status == 200
    assert overlaps == []
    assert await stack.states() == {"a": "RUNNING", "b": "RUNNING"}  # it fit: nobody was put to sleep
    assert stack.sim_count("a", "sleep") == 0
    assert (await stack.state())["swap_queue"] == []


async def test_a_request_that_arrives_while_its_engine_is_put_to_sleep_is_swapped_back_in(
    make_engines: MakeEngines,
) -> None:
    stack = await make_engines(drain_before_sleep_s=5.0)
    release = asyncio.Event()
    a = stack.sim("a")
    a.sleep = held_until(release, a.sleep)  # type: ignore[method-assign]
    for_b = asyncio.ensure_future(stack.completion("model-b"))
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "FALLING_ASLEEP")
    for_a = asyncio.ensure_future(stack.completion("model-a"))
    await stack.wait_for(lambda s: s["engines"]["a"]["held_requests"] == 1)
    release.set()
    first, second = await asyncio.gather(for_b, for_a)
    assert (first.status, second.status) == (200, 200), (await first.text(), await second.text())
    assert stack.sim_count("a", "wake_up") == 1 and stack.sim_count("b", "sleep") == 2  # one before the proxy
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    assert stack.violations() == {}


async def test_many_requests_for_a_sleeping_model_make_one_swap(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    answers = await asyncio.gather(*(stack.completion("model-b", prompt=f"p{i}") for i in range(8)))
    assert [resp.status for resp in answers] == [200] * 8
    assert (stack.sim_count("a", "sleep"), stack.sim_count("b", "wake_up")) == (1, 1)
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_swaps_total{engine="b",outcome="ok"} 1.0' in metrics
    assert stack.violations() == {}


async def test_a_gpu_held_past_the_queue_deadline_is_409_lifecycle_busy(make_engines: MakeEngines) -> None:
    footprint = {"footprint_gib": 38}
    stack = await make_engines(sizes=MEDIUM, engine={"a": footprint, "b": footprint}, lifecycle_queue_timeout_s=0.3)
    release = asyncio.Event()
    b = stack.sim("b")
    b.wake_up = held_until(release, b.wake_up)  # type: ignore[method-assign]
    wake = asyncio.ensure_future(stack.client.post("/engines/b/wake_up"))
    await stack.wait_for(lambda s: any(t["engine"] == "b" and t["running"] for t in s["swap_queue"]))
    busy = await stack.client.post("/engines/a/collective_rpc", json={"method": "reload_weights"})
    release.set()
    assert busy.status == 409
    assert busy.headers["X-Lifeguard-Reason"] == "lifecycle_busy"
    assert "GPU [0]" in (await busy.json())["error"]["message"]
    assert stack.sim_count("a", "collective_rpc") == 0
    assert (await wake).status == 200


async def test_a_wake_wedged_by_an_oom_keeps_failing_cleanly_until_the_engine_restarts(
    make_engines: MakeEngines,
) -> None:
    stack = await make_engines(
        engine={"a": {"pinned": True}, "b": {"footprint_gib": 10}}, sim={"b": {"oom_wedges": True}}
    )
    assert (await stack.completion("model-b")).status == 503
    assert (await stack.client.post("/engines/a/sleep?level=1")).status == 200  # a trainer makes room itself
    again = await stack.completion("model-b")
    assert again.status == 503 and again.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 2 and stack.sim("b").is_sleeping
    stack.sim("b").restart()
    await stack.wait_for(lambda s: s["engines"]["b"]["state"] == "RUNNING")
    assert (await stack.completion("model-b")).status == 200
    assert stack.device_used() <= TOTAL
    assert stack.violations() == {}


async def test_mixed_traffic_for_three_models_never_has_more_awake_than_fits(make_engines: MakeEngines) -> None:
    """The invariant of the chaos run, on a small scale: whatever the interleaving, the device never holds
    more than its total (journalled by the simulators at every memory move), and every request is answered."""
    stack = await make_engines(("a", "b", "c"), asleep=("b", "c"), drain_before_sleep_s=5.0, hold_timeout_s=30.0)
    peaks: list[int] = []
    for name in stack.sims:
        _journal_device_use(stack, stack.sim(name), peaks)
    models = [f"model-{name}" for name in "abcbcaacbbca"]
    answers = await asyncio.gather(*(stack.completion(model, prompt=f"p{i}") for i, model in enumerate(models)))
    assert [resp.status for resp in answers] == [200] * len(models), [
        await r.text() for r in answers if r.status != 200
    ]
    assert peaks and max(peaks) <= TOTAL
    assert sum(stack.sim_count(name, "wake_up") for name in "abc") >= 2  # b and c at least were swapped in
    assert list((await stack.states()).values()).count("RUNNING") == 1
    assert stack.violations() == {}


def _journal_device_use(stack: EnginesStack, engine: Engine, peaks: list[int]) -> None:
    original = engine.publish

    def journalled() -> None:
        original()
        peaks.append(stack.device_used())

    engine.publish = journalled  # type: ignore[method-assign]


# --- found by the two-engine chaos run (`make chaos-engines`, seed 11; docs/reliability.md): regression tests.


async def test_an_unknown_footprint_is_not_woken_beside_a_neighbour_asleep_at_level_0(
    make_engines: MakeEngines,
) -> None:
    """Rule 4: with b's footprint unknown, every engine there that may sleep is put to sleep first, and if
    one cannot be, the wake is refused. `a` asleep at level 0 pauses only its scheduler: its 50 GiB stay on
    the device, and, not being RUNNING, it was neither put to sleep nor counted; b's wake was forwarded
    into vLLM's out of memory (the chaos run: 312 such wakes in 75 s). Here `a` is pinned: refused."""
    stack = await make_engines(engine={"a": {"pinned": True}})  # b SLEEPING, never woken here: footprint unknown
    assert (await stack.client.post("/engines/a/sleep?level=0")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert "a" in (await resp.json())["error"]["message"]
    assert stack.sim_count("b", "wake_up") == 0
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_neighbour_asleep_at_level_0_is_put_to_a_real_sleep_before_a_wake(make_engines: MakeEngines) -> None:
    """The same neighbour, free to sleep: woken (its memory is all there, the wake adds nothing), then put
    to sleep at its swap_sleep_level, verified; then b wakes into the room."""
    stack = await make_engines()
    assert (await stack.client.post("/engines/a/sleep?level=0")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.sim("a").state_dict()["sleep_level"] == 1
    assert stack.sim_count("b", "wake_up") == 1 and stack.sim_count("a", "wake_up") == 1
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_paused_neighbour_keeps_its_memory_and_is_put_to_sleep_or_refuses(make_engines: MakeEngines) -> None:
    """A paused engine holds all its memory: put to sleep for the wake when it may be (and its pause kept),
    counted when it may not."""
    stack = await make_engines(engine={"a": {"pinned": True}})
    assert (await stack.client.post("/engines/a/pause")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 0

    stack = await make_engines()
    assert (await stack.client.post("/engines/a/pause")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_partly_awake_neighbour_keeps_its_memory_and_refuses_an_unknown_wake(
    make_engines: MakeEngines,
) -> None:
    """Woken with its KV cache only, `a` holds 34 GiB and vLLM's /sleep would not give them back (the
    executor still counts as asleep): with b's footprint unknown, b is refused, never woken into an OOM."""
    stack = await make_engines(asleep=("a", "b"))
    assert (await stack.client.post("/engines/a/wake_up?tags=kv_cache")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 0
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_wake_from_level_0_needs_no_memory_and_is_not_refused_for_want_of_it(
    make_engines: MakeEngines,
) -> None:
    """A level-0 sleep keeps every byte on the device (only the scheduler sleeps), so its wake adds
    nothing; the arbiter asked for the engine's whole footprint and refused it beside a pinned neighbour
    (the chaos run: 914 `no_room` swaps of b, 1,078 requests 503 insufficient_gpu_memory)."""
    stack = await make_engines(
        sizes=MEDIUM, asleep=(), engine={"a": {"pinned": True}, "b": {"footprint_gib": 36}}
    )  # 38 GiB each awake: both fit, 4 GiB free
    assert (await stack.client.post("/engines/b/sleep?level=0")).status == 200
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()


async def test_a_partial_wake_asks_only_for_the_rest(make_engines: MakeEngines) -> None:
    """Seed 11, second run: `a` woke its KV cache alone (34 GiB on the device), then every wake of its
    weights (16 GiB more, 46 GiB free) was refused for want of its whole footprint (2,483 no_room swaps)."""
    stack = await make_engines(asleep=("a", "b"), engine={"a": {"footprint_gib": 50}, "b": {"pinned": True}})
    assert (await stack.client.post("/engines/a/wake_up?tags=kv_cache")).status == 200
    resp = await stack.completion("model-a")
    assert resp.status == 200, await resp.text()
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_failed_neighbour_keeps_its_memory_in_the_books(make_engines: MakeEngines) -> None:
    """Chaos seed 11 (after the two fixes above): b's wake failed its canary, b FAILED with its 50 GiB on
    the device; a's footprint unknown, admission saw nobody keeping memory and woke a into vLLM's out of
    memory, 68 times. A failed or starting engine may hold everything: refused instead."""
    stack = await make_engines(asleep=("a", "b"))
    stack.sim("a").set_faults(["wake_up:garbage"])
    assert (await stack.client.post("/engines/a/wake_up")).status == 503  # the canary fails: FAILED
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "FAILED")
    resp = await stack.completion("model-b")
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 0
    assert stack.device_used() <= TOTAL


async def test_a_sleep_that_freed_nothing_is_woken_for_free_then_put_to_a_real_sleep(
    make_engines: MakeEngines,
) -> None:
    """Chaos seed 7: `a` asleep by its flags after a sleep that freed nothing (lie-memory), its 50 GiB still
    on the device. vLLM's /sleep does nothing to an executor asleep already, so it cannot make room: b is
    refused. a's own wake adds nothing (its own reading shows all of it there) and is no longer refused for
    want of its whole footprint; awake again, it can be put to a real sleep for b."""
    stack = await make_engines()
    stack.sim("a").set_faults(["sleep:lie-memory"])
    slept = await stack.client.post("/engines/a/sleep?level=1")
    # The lie is caught: the memory check fails the sleep, and a is held asleep by its flags.
    assert slept.status == 503 and slept.headers["X-Lifeguard-Reason"] == "verification_failed", await slept.text()
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "SLEEPING" and not s["engines"]["a"]["lifecycle_busy"])
    stack.sim("a").set_faults([])
    resp = await stack.completion("model-b")
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "insufficient_gpu_memory"
    assert stack.sim_count("b", "wake_up") == 0
    assert (resp := await stack.completion("model-a")).status == 200, await resp.text()
    assert (resp := await stack.completion("model-b")).status == 200, await resp.text()
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_trainers_level_0_sleep_landing_before_the_swaps_sleep_is_woken_and_put_to_sleep(
    make_engines: MakeEngines,
) -> None:
    """Chaos seed 11: a was PAUSED when the plan chose it; a trainer's sleep?level=0 took a's lock first,
    and the swap's sleep at level 2 was refused `already_asleep`: a kept its memory and b was refused."""
    stack = await make_engines(engine={"a": {"swap_sleep_level": 2}})
    coordinator = stack.lifeguard.engines["a"].coordinator
    original = coordinator.submit_unguarded
    landed: list[str] = []

    async def trainer_first(call: LifecycleCall) -> Outcome:
        if call.op == "sleep" and call.level == 2 and not landed:
            landed.append("level 0")
            await original(LifecycleCall("sleep", (("level", "0"),), level=0))
        return await original(call)

    coordinator.submit_unguarded = trainer_first
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    assert landed and stack.sim("a").state_dict()["sleep_level"] == 2
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_neighbour_on_its_way_to_a_pause_is_put_to_sleep_after_it(make_engines: MakeEngines) -> None:
    """Chaos seed 11: 145 swaps refused no_room for a neighbour "in a lifecycle call" (a trainer's pause or
    resume under way) that could be put to sleep a moment later: the swap's sleep now waits its turn."""
    stack = await make_engines()
    release = asyncio.Event()
    a = stack.sim("a")
    original_pause = a.pause

    async def held_pause(mode: str) -> dict[str, object]:
        await asyncio.wait_for(release.wait(), 10)
        return await original_pause(mode)

    a.pause = held_pause  # type: ignore[method-assign]
    pause = asyncio.ensure_future(stack.client.post("/engines/a/pause"))
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "PAUSING")
    request = asyncio.ensure_future(stack.completion("model-b"))
    await stack.wait_for(lambda s: any(t["engine"] == "b" and t["running"] for t in s["swap_queue"]))
    release.set()
    assert (await pause).status == 200
    resp = await request
    assert resp.status == 200, await resp.text()
    assert await stack.states() == {"a": "SLEEPING", "b": "RUNNING"}
    assert stack.device_used() <= TOTAL and stack.violations() == {}


async def test_a_request_held_while_its_engine_started_wakes_it_once_it_is_found_asleep(
    aiohttp_server: Any, serve_lifeguard: Any, unused_tcp_port: int, tmp_path: Any
) -> None:
    """Was: a request for `b` that arrived before the proxy had read b's state (STARTING) was held, b was then
    found asleep, and nothing asked for its wake: the request waited out its whole hold deadline (300 s by
    default; the CLI test of two engines from a config file hung in CI on it). Made certain here: b's vLLM
    is not up yet when the request arrives, and comes up asleep."""
    from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
    from proxy.config import Settings
    from tests.e2e.conftest import BIG, FAST_SIM, TEST_TIMINGS

    gpu_file = tmp_path / "gpu.json"

    def sim(name: str) -> Any:
        return create_sim_app(
            SimSettings(
                **{**FAST_SIM.__dict__, "model": f"model-{name}", "gpu_file": gpu_file, "gpu_file_engine": name, **BIG}
            )  # fmt: skip
        )

    a = await aiohttp_server(sim("a"))
    engines = [
        {"name": "a", "upstream": str(a.make_url("")).rstrip("/"), "models": ["model-a"]},
        {"name": "b", "upstream": f"http://127.0.0.1:{unused_tcp_port}", "models": ["model-b"]},
    ]
    client = await serve_lifeguard(
        Settings(engines=engines, gpu_probe=f"file:{gpu_file}", **{**TEST_TIMINGS, "hold_timeout_s": 20.0})
    )
    body = {"model": "model-b", "prompt": "x", "max_tokens": 2}
    held = asyncio.ensure_future(client.post("/v1/completions", json=body))
    async with asyncio.timeout(10):
        while (await (await client.get("/lifeguard/state")).json())["engines"]["b"]["held_requests"] != 1:
            await asyncio.sleep(0.01)
    assert (await (await client.get("/lifeguard/state")).json())["engines"]["b"]["state"] == "STARTING"
    b_app = sim("b")
    await b_app[SIM_ENGINE].sleep(1, "abort")
    await aiohttp_server(b_app, port=unused_tcp_port)  # b's vLLM comes up, asleep
    resp = await asyncio.wait_for(held, 15)  # inside the hold deadline: woken, not timed out
    assert resp.status == 200, await resp.text()
    state = await (await client.get("/lifeguard/state")).json()
    assert {name: engine["state"] for name, engine in state["engines"].items()} == {"a": "SLEEPING", "b": "RUNNING"}
