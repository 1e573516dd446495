"""Engine behaviour the conformance suite cannot see from outside: counters, disconnects, state."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conformance.api import StreamResult, eventually
from tests.sim.conftest import Sim


async def test_counters_count_every_call_per_operation(sim: Sim) -> None:
    await sim.api.sleep(1)
    await sim.api.sleep(1)
    await sim.api.wake()
    await sim.api.completion()
    counters = (await sim.state())["counters"]
    assert (counters["sleep"], counters["wake_up"], counters["generate"]) == (2, 1, 1)


async def test_a_client_disconnect_aborts_its_generation(sim: Sim) -> None:
    result = StreamResult()
    stream = asyncio.create_task(sim.api.stream_completion(result, max_tokens=400))
    await asyncio.wait_for(result.first_text.wait(), 10)
    stream.cancel()

    async def idle() -> bool:
        return sim.engine.scheduler.running == 0

    await eventually(idle, what="the engine to drop the abandoned request")
    assert sim.engine.scheduler.client_disconnects == 1
    assert sim.engine.scheduler.stats.generation_tokens < 400


async def test_a_held_client_that_leaves_is_dropped_from_the_queue(sim: Sim) -> None:
    await sim.api.post("/pause", mode="keep")  # a pause that queues new requests on every release
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as other:
        request = asyncio.create_task(
            other.post(sim.api.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        )

        async def held() -> bool:
            return sim.engine.scheduler.waiting == 1

        await eventually(held)
        request.cancel()
    await eventually(lambda: _waiting_is(sim, 0), what="the engine to drop the abandoned held request")
    assert sim.engine.scheduler.client_disconnects == 1


async def _waiting_is(sim: Sim, n: int) -> bool:
    return sim.engine.scheduler.waiting == n


async def test_state_reports_held_requests_as_waiting(sim: Sim) -> None:
    await sim.api.sleep(1)
    request = asyncio.create_task(sim.api.completion())
    await eventually(lambda: _waiting_is(sim, 1))
    state = await sim.state()
    assert (state["waiting"], state["running"], state["is_sleeping"]) == (1, 0, True)
    await sim.api.wake()
    await request


async def test_chat_without_max_tokens_stops_naturally(sim: Sim) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    answer = await sim.api.call("POST", "/v1/chat/completions", json_body=body)
    assert answer.body["choices"][0]["finish_reason"] == "stop"


async def test_stop_strings_cut_the_text(sim: Sim) -> None:
    full = (await sim.api.completion(prompt="x", max_tokens=12)).body["choices"][0]["text"]
    word = full.split()[3]
    cut = await sim.api.completion(prompt="x", max_tokens=12, stop=[word])
    choice = cut.body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert word not in choice["text"]
    assert full.startswith(choice["text"])


async def test_a_wake_naming_a_tag_that_is_awake_wakes_nothing(sim: Sim) -> None:
    await sim.api.sleep(1)
    await sim.api.wake("weights")
    answer = await sim.api.wake("weights", "kv_cache")
    assert (answer.status, answer.body["status"]) == (200, "sleeping")
    assert (await sim.state())["asleep_tags"] == ["kv_cache"]
