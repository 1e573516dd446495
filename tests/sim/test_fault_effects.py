"""Each fault kind's observable effect, through HTTP, on an in-process simulator."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import aiohttp
import pytest

from lifeguard_sim.errors import OOM_MESSAGE
from tests.conformance.api import eventually, still_pending
from tests.sim.conftest import Sim, SimFactory

GIB = 1 << 30


async def _set_faults(sim: Sim, *specs: str) -> None:
    answer = await sim.api.call("POST", "/sim/faults", json_body=list(specs))
    assert answer.status == 200, answer.text


async def test_faults_can_be_set_listed_and_cleared_at_run_time(sim: Sim) -> None:
    await _set_faults(sim, "wake_up:error500@2", "sleep:slow:0.1")
    listed = (await sim.api.get("/sim/faults")).body
    assert [f["spec"] for f in listed] == ["wake_up:error500@2", "sleep:slow:0.1"]
    await _set_faults(sim)
    assert (await sim.api.get("/sim/faults")).body == []


async def test_a_bad_fault_spec_is_400_naming_it(sim: Sim) -> None:
    answer = await sim.api.call("POST", "/sim/faults", json_body=["wake_up:error500", "wake_up:melt"])
    assert answer.status == 400
    assert "wake_up:melt" in answer.body["error"]


async def test_error500_answers_vllms_body_and_leaves_state_unchanged(sim: Sim) -> None:
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:error500")
    answer = await sim.api.wake()
    assert answer.status == 500
    assert answer.body["error"] == {
        "message": f"Call to wake_up method failed: {OOM_MESSAGE}",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert await sim.api.is_sleeping()
    assert (await sim.api.wake()).status == 200
    assert not await sim.api.is_sleeping()


async def test_pause_error500_uses_the_plain_error_shape(sim: Sim) -> None:
    await _set_faults(sim, "pause:error500")
    answer = await sim.api.post("/pause")
    assert answer.status == 500
    assert answer.body == {"error": f"Failed to pause generation: {OOM_MESSAGE}"}
    assert not await sim.api.is_paused()


async def test_wedge_makes_every_later_wake_fail(sim: Sim) -> None:
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:wedge")
    for _ in range(3):
        assert (await sim.api.wake()).status == 500
    assert await sim.api.is_sleeping()
    assert (await sim.state())["wedged"] == ["wake_up"]


async def test_crash_resets_the_connection_and_every_later_one_until_restart(sim: Sim) -> None:
    await _set_faults(sim, "sleep:crash")
    with pytest.raises(aiohttp.ClientConnectionError):
        await sim.api.sleep(1)
    assert sim.engine.dead
    with pytest.raises(aiohttp.ClientConnectionError):
        await sim.api.get("/health")
    sim.engine.restart()
    assert (await sim.api.get("/health")).status == 200
    assert not await sim.api.is_sleeping()
    assert sim.engine.counters["sleep"] == 1


async def test_crash_during_generate_cuts_the_stream_mid_way(sim: Sim) -> None:
    await _set_faults(sim, "generate:crash")
    with pytest.raises(aiohttp.ClientError):
        await sim.api.completion(max_tokens=20, stream=True)
    assert sim.engine.dead


async def test_crash_resets_requests_the_engine_was_holding(sim: Sim) -> None:
    await sim.api.post("/pause", mode="keep")  # a pause that queues new requests on every release
    held = asyncio.create_task(sim.api.completion(max_tokens=4))
    await eventually(lambda: _load_is(sim, 1))
    await _set_faults(sim, "resume:crash")
    with pytest.raises(aiohttp.ClientConnectionError):
        await sim.api.post("/resume")
    with pytest.raises(aiohttp.ClientConnectionError):
        await asyncio.wait_for(held, 10)


async def _load_is(sim: Sim, n: int) -> bool:
    return await sim.api.server_load() == n


async def test_hang_never_answers_until_shutdown(sim: Sim) -> None:
    await _set_faults(sim, "wake_up:hang")
    call = asyncio.create_task(sim.api.wake())
    assert await still_pending(call)
    assert (await sim.api.get("/health")).status == 200
    await sim.server.close()
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(call, 10)


async def test_lie_asleep_answers_awake_but_stays_asleep(sim: Sim) -> None:
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:lie-asleep")
    answer = await sim.api.wake()
    assert (answer.status, answer.body["status"]) == (200, "awake")
    assert await sim.api.is_sleeping()
    assert (await sim.state())["memory"]["used_bytes"] == 2 * GIB


async def test_lie_memory_wakes_the_flags_but_not_the_memory(sim: Sim) -> None:
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:lie-memory")
    answer = await sim.api.wake()
    assert (answer.status, answer.body["status"]) == (200, "awake")
    assert not await sim.api.is_sleeping()
    assert (await sim.state())["memory"]["used_bytes"] == 2 * GIB


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("0.32", "EngineCore encountered an issue. See stack trace (above) for the root cause."),
        ("0.33", "The server had an error while processing your request."),  # EngineDeadError.CLIENT_MESSAGE
    ],
)
async def test_lie_dead_answers_200_then_the_engine_is_dead(make_sim: SimFactory, version: str, message: str) -> None:
    sim = await make_sim(watchdog_seconds=30, vllm_version=version)
    await _set_faults(sim, "sleep:lie-dead")
    assert (await sim.api.sleep(1)).status == 200
    assert (await sim.api.get("/health")).status == 503
    answer = await sim.api.completion()
    assert answer.status == 500
    assert answer.body["error"] == {"message": message, "type": "InternalServerError", "param": None, "code": 500}
    wake = await sim.api.wake()  # a lifecycle call on a dead engine: the same answer
    assert (wake.status, wake.body["error"]["message"]) == (500, message)
    # /is_paused quotes str(EngineDeadError), the old text, on both releases (rl/online/api_router.py)
    paused = await sim.api.get("/is_paused")
    old_text = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    assert (paused.status, paused.body) == (500, {"error": "Failed to fetch pause status: " + old_text})


async def test_lie_dead_ends_the_process_after_the_watchdog(sim: Sim) -> None:
    await _set_faults(sim, "wake_up:lie-dead")
    assert (await sim.api.wake()).status == 200
    assert (await sim.api.get("/health")).status == 503

    async def process_gone() -> bool:
        try:
            await sim.api.get("/health")
        except aiohttp.ClientConnectionError:
            return True
        return False

    await eventually(process_gone, timeout=5, what="the watchdog to end the process")
    assert sim.engine.death_reason == "watchdog: engine core died"


async def test_garbage_makes_completions_degenerate_with_nan_logprobs(sim: Sim) -> None:
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:garbage")
    assert (await sim.api.wake()).status == 200
    answer = await sim.api.completion(max_tokens=6, logprobs=1)
    choice = answer.body["choices"][0]
    assert choice["text"] == "!" * 6
    assert all(math.isnan(lp) for lp in choice["logprobs"]["token_logprobs"])


async def test_garbage_clears_after_reload_weights(sim: Sim) -> None:
    await _set_faults(sim, "generate:garbage")
    assert (await sim.api.completion(max_tokens=3)).body["choices"][0]["text"] == "!!!"
    await sim.api.call("POST", "/collective_rpc", json_body={"method": "reload_weights"})
    assert (await sim.api.completion(max_tokens=3)).body["choices"][0]["text"] != "!!!"


async def test_slow_adds_its_seconds_to_the_operation(sim: Sim) -> None:
    await _set_faults(sim, "sleep:slow:0.3")
    started = time.monotonic()
    assert (await sim.api.sleep(1)).status == 200
    assert time.monotonic() - started >= 0.3


async def test_faults_given_at_start_are_armed(make_sim: SimFactory) -> None:
    sim = await make_sim(faults=("generate:error500@2",))
    assert (await sim.api.completion()).status == 500
    assert (await sim.api.completion()).status == 500
    assert (await sim.api.completion()).status == 200


async def _answer_of(sim: Sim, model: str) -> tuple[str, float]:
    body = {"model": model, "prompt": "The river", "max_tokens": 1, "temperature": 0, "logprobs": 1}
    answer = await sim.api.call("POST", "/v1/completions", json_body=body)
    assert answer.status == 200, answer.text
    choice = answer.body["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"][0]


async def test_lose_lora_keeps_the_adapter_listed_but_it_answers_like_the_base_model(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    """vLLM #53888: after a level-1 sleep and a wake the adapter route answers like the base model, with no error."""
    sim = await make_sim(enable_lora=True)
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    adapter = {"lora_name": "sql", "lora_path": str(tmp_path)}
    assert (await sim.api.call("POST", "/v1/load_lora_adapter", json_body=adapter)).status == 200
    base, tuned = await _answer_of(sim, "tiny"), await _answer_of(sim, "sql")
    assert tuned != base  # an adapter answers otherwise than the base model
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:lose-lora")
    assert (await sim.api.wake()).status == 200
    listed = [card["id"] for card in (await sim.api.get("/v1/models")).body["data"]]
    assert listed == ["tiny", "sql"]
    assert await _answer_of(sim, "sql") == base
    assert (await sim.state())["lora_lost"] == ["sql"]
    again = {**adapter, "load_inplace": True}
    assert (await sim.api.call("POST", "/v1/load_lora_adapter", json_body=again)).status == 200
    assert await _answer_of(sim, "sql") == tuned


async def test_lose_lora_needs_the_weights_to_wake(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim(enable_lora=True)
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    await sim.api.call("POST", "/v1/load_lora_adapter", json_body={"lora_name": "a", "lora_path": str(tmp_path)})
    await sim.api.sleep(1)
    await _set_faults(sim, "wake_up:lose-lora@2")
    await sim.api.wake("kv_cache")
    assert (await sim.state())["lora_lost"] == []  # the weights still sleep: nothing was woken to lose it
    await sim.api.wake("weights")
    assert (await sim.state())["lora_lost"] == ["a"]


async def test_a_scale_down_past_this_rank_retires_it_without_a_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(data_parallel_size=2, data_parallel_rank=1)
    answer = await sim.api.call("POST", "/scale_elastic_ep", json_body={"new_data_parallel_size": 1})
    assert answer.status == 200
    assert (await sim.api.get("/health")).status == 200
    assert (await sim.api.get("/is_sleeping")).status == 503
    assert (await sim.state())["elastic_ep"]["retired"] is True
    sim.engine.errored = True  # its engine core died: AsyncLLM.check_health returns before looking
    assert (await sim.api.get("/health")).status == 200


async def test_rank_zero_is_not_retired_by_a_scale_down(make_sim: SimFactory) -> None:
    sim = await make_sim(data_parallel_size=2, data_parallel_rank=0)
    assert (await sim.api.call("POST", "/scale_elastic_ep", json_body={"new_data_parallel_size": 1})).status == 200
    assert (await sim.api.get("/is_sleeping")).status == 200
