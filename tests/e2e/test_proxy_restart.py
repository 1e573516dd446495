"""A proxy restarted beside the same vLLM (a sidecar OOM-killed or updated): it adopts what it can read from
vLLM, keeps what vLLM cannot tell in its state file, and holds inference wherever it cannot vouch for the
weights (issue 20). The old proxy is stopped and a new one is built from the same settings, with nothing in
common but the simulator and the state file, as after a restart of the process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import Stack


async def _restarted(stack: Stack, serve_lifeguard: Any) -> TestClient[Any, Any]:
    await stack.client.close()
    client: TestClient[Any, Any] = await serve_lifeguard(stack.settings)
    deadline = time.monotonic() + 5
    while True:
        state = await (await client.get("/lifeguard/state")).json()
        if state["state"] not in ("STARTING",) and not state["lifecycle_busy"]:
            return client
        assert time.monotonic() < deadline, f"the new proxy never adopted the engine: {state}"
        await asyncio.sleep(0.01)


async def _state(client: TestClient[Any, Any]) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get("/lifeguard/state")).json()
    return body


async def _held(client: TestClient[Any, Any]) -> asyncio.Future[Any]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    request = asyncio.ensure_future(client.post("/v1/completions", json=body))
    deadline = time.monotonic() + 5
    while (await _state(client))["held_requests"] != 1:
        assert not request.done(), await request.result().text()
        assert time.monotonic() < deadline, "the completion was not held"
        await asyncio.sleep(0.01)
    return request


async def test_a_proxy_restarted_while_vllm_sleeps_at_level_2_holds_inference_after_the_wake(
    make_stack: Any, serve_lifeguard: Any
) -> None:
    stack = await make_stack()
    assert (await stack.client.post("/sleep", params={"level": "2"})).status == 200
    client = await _restarted(stack, serve_lifeguard)  # no state file: vLLM's gauge says discard_all
    state = await _state(client)
    assert state["state"] == "SLEEPING" and state["sleep_level"] == 2
    assert state["weights_stale_reason"] == "discarded"

    assert (await client.post("/wake_up")).status == 200
    request = await _held(client)
    assert stack.sim.violations == []
    assert (await client.post("/collective_rpc", json={"method": "reload_weights"})).status == 200
    assert (await request).status == 200
    assert stack.sim.violations == []


async def test_with_a_state_file_a_proxy_restarted_after_a_level_2_wake_still_holds_until_a_reload(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/sleep", params={"level": "2"})).status == 200
    assert (await stack.client.post("/wake_up")).status == 200
    client = await _restarted(stack, serve_lifeguard)  # vLLM is awake: only the state file remembers
    state = await _state(client)
    assert state["state"] == "RUNNING" and state["weights_stale_reason"] == "discarded"

    request = await _held(client)
    assert (await client.post("/collective_rpc", json={"method": "reload_weights"})).status == 200
    assert (await request).status == 200
    assert stack.sim.violations == []


async def test_with_a_state_file_a_pause_recorded_while_asleep_survives_a_restart(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    assert "X-Lifeguard-Deferred" in (await stack.client.post("/pause", params={"mode": "keep"})).headers
    client = await _restarted(stack, serve_lifeguard)
    assert (await _state(client))["pause_mode"] == "keep"

    wake = await client.post("/wake_up")
    assert wake.status == 200 and wake.headers["X-Lifeguard-Pause-Kept"] == "keep"
    assert (await _state(client))["state"] == "PAUSED"
    assert stack.sim.is_paused


async def test_an_unreadable_state_file_means_the_weights_cannot_be_vouched_for(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    state_file = tmp_path / "lifeguard-state.json"
    stack = await make_stack(state_file=str(state_file))
    state_file.write_text("{not json")
    client = await _restarted(stack, serve_lifeguard)
    state = await _state(client)
    assert state["state"] == "RUNNING" and state["weights_stale"] is True
    await _held(client)


async def test_with_a_state_file_a_proxy_restarted_after_a_lying_wake_keeps_the_engine_asleep(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """Chaos finding (bounded run, seed 7364): the wake answered 200 but nothing woke, and vLLM's gauge reads
    awake. A new proxy sees the flags "asleep and paused" with the gauge "awake", exactly a pause; only the state
    file knows the tags are still asleep. Taken for PAUSED, it let a weight reload onto sleeping weights."""
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    stack.faults("wake_up:lie-asleep")
    assert (await stack.client.post("/wake_up")).status == 503
    client = await _restarted(stack, serve_lifeguard)
    state = await _state(client)
    assert state["state"] == "SLEEPING" and state["asleep_tags"] == ["kv_cache", "weights"]

    reload = await client.post("/collective_rpc", json={"method": "reload_weights"})
    assert reload.status == 409
    await _held(client)
    assert (await client.post("/wake_up")).status == 200
    assert (await _state(client))["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_with_a_state_file_an_unconfirmed_sleep_stays_unconfirmed_across_a_restart(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """Chaos finding (bounded run with restarts, seed 9599): a /sleep from PAUSED that did nothing is held as
    asleep but unconfirmed, so a repeat is sent to vLLM (test_lies 1c). The state file kept the tags and not
    that they were unconfirmed: the new proxy, seeing "asleep and paused" with the gauge "awake", took them for
    a confirmed sleep and answered the next two /sleep?level=1 as no-ops on an engine merely paused."""
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/pause")).status == 200
    stack.faults("sleep:lie-asleep")
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 503
    assert (await _state(stack.client))["sleep_unconfirmed"] is True
    client = await _restarted(stack, serve_lifeguard)
    state = await _state(client)
    assert state["state"] == "SLEEPING" and state["sleep_unconfirmed"] is True
    await _a_repeated_sleep_reaches_the_merely_paused_engine(stack, client)
    assert (await _state(client))["sleep_unconfirmed"] is False
    assert (await client.post("/wake_up")).status == 200
    assert (await _state(client))["state"] == "PAUSED"  # the user's pause outlives the sleep and the restart
    assert stack.sim.violations == []


async def test_a_sleep_a_restarted_proxy_reads_only_from_the_gauge_is_unconfirmed(
    make_stack: Any, serve_lifeguard: Any
) -> None:
    """Chaos finding (bounded run with restarts, seed 9599, raw plane): the proxy was killed while a /sleep from
    PAUSED was in flight, and that sleep did nothing but set vLLM's sleep-state gauge (a lie). The new proxy had
    only the gauge to go by, no GPU footprint to compare with, took it for a confirmed sleep at level 1 and
    answered the next /sleep?level=1 as no-ops on an engine merely paused."""
    stack = await make_stack()
    assert (await stack.client.post("/pause")).status == 200
    stack.faults("sleep:lie-asleep")
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 503
    client = await _restarted(stack, serve_lifeguard)  # no state file: the answer of that sleep is lost with it
    state = await _state(client)
    assert state["state"] == "SLEEPING" and state["sleep_level"] == 1 and state["sleep_unconfirmed"] is True
    await _a_repeated_sleep_reaches_the_merely_paused_engine(stack, client)
    assert stack.sim.violations == []


async def _a_repeated_sleep_reaches_the_merely_paused_engine(stack: Any, client: Any) -> None:
    engine = stack.sim.state_dict()
    assert engine["paused"] is True and engine["asleep_tags"] == [], engine  # only paused
    again = await client.post("/sleep", params={"level": "1"})
    assert again.status == 200, await again.text()
    assert "X-Lifeguard-Noop" not in again.headers
    assert stack.sim_count("sleep") == 2


async def test_a_proxy_restarted_while_skyrls_worker_holds_the_memory_asleep_still_refuses_a_resume(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    # vLLM's flags read "paused" only: the state file alone says the weights and KV cache are freed.
    sim = SimSettings(token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.01, trainer_servers=("skyrl",))
    stack = await make_stack(sim=sim, state_file=str(tmp_path / "state.json"))
    assert (await stack.client.post("/pause", params={"mode": "keep"})).status == 200
    rpc = {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": True}}
    assert (await stack.client.post("/collective_rpc", json=rpc)).status == 200
    client = await _restarted(stack, serve_lifeguard)
    state = await _state(client)
    assert (state["state"], state["asleep_outside_vllm"], state["weights_stale_reason"]) == (
        "SLEEPING",
        True,
        "discarded",
    ), state
    refused = await client.post("/resume")
    assert refused.status == 409 and refused.headers["X-Lifeguard-Reason"] == "engine_asleep"
    for tags in (["weights"], ["kv_cache"]):
        rpc = {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": tags}}
        assert (await client.post("/collective_rpc", json=rpc)).status == 200
    assert (await client.post("/resume")).status == 200
    assert stack.sim.violations == []


async def test_with_a_state_file_a_proxy_restarted_after_a_weight_checker_reset_holds_until_a_reload(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/weight_checker", json={"action": "reset"})).status == 200
    client = await _restarted(stack, serve_lifeguard)  # vLLM is awake and says nothing of the zeroed weights
    state = await _state(client)
    assert state["state"] == "RUNNING" and state["weights_stale_reason"] == "reset"

    request = await _held(client)
    assert (await client.post("/collective_rpc", json={"method": "reload_weights"})).status == 200
    assert (await request).status == 200
    assert stack.sim.violations == []


async def test_with_a_state_file_a_weight_update_session_survives_a_restart(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """Found by `make chaos-pods` (seed 303): a proxy killed while vLLM held a session after a level-2 sleep took
    the trainer's next /update_weights for a whole update of its own, let the held requests go, and they ran on
    discarded weights. vLLM cannot be asked whether a session is open: the state file keeps it."""
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/sleep", params={"level": "2"})).status == 200
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await stack.client.post("/start_weight_update", json={})).status == 200
    client = await _restarted(stack, serve_lifeguard)  # vLLM is awake with a session open; only the file knows

    request = await _held(client)
    assert (await client.post("/update_weights", json={"update_info": {}})).status == 200
    state = await _state(client)
    assert state["held_requests"] == 1 and not request.done(), "an update inside the session does not end it"
    assert state["state"] == "UPDATING_WEIGHTS" and state["weight_update_active"] is True, state
    assert stack.sim.violations == []
    assert (await client.post("/finish_weight_update", json={})).status == 200
    assert (await request).status == 200
    state = await _state(client)
    assert state["state"] == "RUNNING" and state["weights_stale"] is False, state
    assert stack.sim.violations == []


async def test_a_session_remembered_on_a_paused_engine_is_still_a_session_after_the_restart(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """Found by `make chaos-pods` (seeds 101, 102): the RL path (pause keep, then a session) with the proxy killed
    inside it. vLLM's flags say only "paused"; the restarted proxy settled PAUSED beside the session its file kept,
    let a level-2 sleep and a /resume into it, and the finish then returned to the PAUSED of the session's start:
    the next /pause and /sleep were answered as no-ops on an engine that was running, or asleep at another level."""
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/pause", params={"mode": "keep"})).status == 200
    assert (await stack.client.post("/start_weight_update", json={})).status == 200
    client = await _restarted(stack, serve_lifeguard)  # vLLM paused with a session open; only the file knows

    state = await _state(client)
    assert state["state"] == "UPDATING_WEIGHTS" and state["weight_update_active"] is True, state
    for op, params in (("sleep", {"level": "2"}), ("resume", {}), ("pause", {"mode": "keep"})):
        refused = await client.post(f"/{op}", params=params)
        assert refused.status == 409, (op, await refused.text())
        assert refused.headers["X-Lifeguard-Reason"] == "weight_update_in_progress", op
    assert stack.sim.sleep_level is None and stack.sim.is_paused, "nothing reached vLLM"

    assert (await client.post("/finish_weight_update", json={})).status == 200
    assert (await _state(client))["state"] == "PAUSED"
    assert (await client.post("/resume")).status == 200
    assert not stack.sim.is_paused and (await _state(client))["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_a_session_the_state_file_remembers_but_vllm_lost_is_closed_at_the_finish(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """The file is pessimistic: a session it keeps that vLLM no longer holds (vLLM restarted while the proxy was
    down) ends at the trainer's finish, which vLLM refuses, with the weights marked stale and a sentence saying so."""
    stack = await make_stack(state_file=str(tmp_path / "lifeguard-state.json"))
    assert (await stack.client.post("/start_weight_update", json={})).status == 200
    await stack.client.close()
    stack.sim.weight_update_active = False  # the session vLLM lost, as a restart of vLLM loses it
    client = await _restarted(stack, serve_lifeguard)
    assert (await _state(client))["state"] == "UPDATING_WEIGHTS"

    finish = await client.post("/finish_weight_update", json={})
    assert finish.status == 409, await finish.text()
    assert "no weight update session open" in (await finish.json())["error"]["message"]
    state = await _state(client)
    assert state["weight_update_active"] is False and state["weights_stale"] is True, state


async def test_without_a_state_file_vllms_200_to_an_update_inside_a_session_tells_the_proxy_of_it(
    make_stack: Any, serve_lifeguard: Any
) -> None:
    """vLLM's own /update_weights answers 200 only inside a session: a proxy restarted without its state file
    learns of the session from it and holds it, so the trainer's finish reaches vLLM instead of a 409."""
    stack = await make_stack()
    assert (await stack.client.post("/start_weight_update", json={})).status == 200
    client = await _restarted(stack, serve_lifeguard)
    assert (await _state(client))["weight_update_active"] is False  # nothing says so yet

    assert (await client.post("/update_weights", json={"update_info": {}})).status == 200
    state = await _state(client)
    assert state["state"] == "UPDATING_WEIGHTS" and state["weight_update_active"] is True, state
    await _held(client)  # inference waits for the finish, as in any session
    finish = await client.post("/finish_weight_update", json={})
    assert finish.status == 200, await finish.text()
    assert not stack.sim.weight_update_active
    assert (await _state(client))["state"] == "RUNNING"
