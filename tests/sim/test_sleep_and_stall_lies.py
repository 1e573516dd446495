"""Two lies of vLLM 0.33 and 0.34 (and already 0.32's worker): a /sleep that answers 500 after the memory was freed,
and a stall behind a healthy /health."""

from __future__ import annotations

import asyncio

import pytest

from lifeguard_sim.memory import GIB
from lifeguard_sim.versions import ENGINE_DEAD_CLIENT_MESSAGE
from tests.conformance.api import StreamResult, still_pending
from tests.sim.conftest import Sim, SimFactory

# Worker.sleep's `assert freed_bytes >= 0, "Memory usage increased after sleeping."` (v1/worker/gpu_worker.py), through
# EngineCoreProc._invoke_utility_method's failure message, as the generic exception handler renders it.
FREED_500 = {
    "error": {
        "message": "Call to sleep method failed: Memory usage increased after sleeping.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
OVERHEAD_ONLY = 2 * GIB  # the FAST sizes: 16 GiB of weights and 40 of KV cache freed, 2 GiB that never sleep


async def _freed_500(sim: Sim) -> None:
    sim.engine.set_faults(["sleep:freed-500"])
    answer = await sim.api.sleep(1)
    assert (answer.status, answer.body) == (500, FREED_500)


@pytest.mark.parametrize("version", ["0.33", "0.34"])
async def test_a_sleep_500_after_freeing_leaves_the_executor_awake_so_the_wake_is_a_no_op(
    make_sim: SimFactory, version: str
) -> None:
    sim = await make_sim(vllm_version=version, watchdog_seconds=30)
    await _freed_500(sim)
    state = await sim.state()
    assert state["memory"]["used_bytes"] == OVERHEAD_ONLY  # the memory went
    assert (state["asleep_tags"], state["sleep_unrecorded"]) == ([], ["kv_cache", "weights"])
    assert await sim.api.is_sleeping()  # the scheduler was paused first
    assert await sim.api.sleep_state_metric() == (1.0, 0.0, 0.0)  # AsyncLLM.sleep raised before recording it
    # Executor.wake_up: "Executor is not sleeping", then fully awake, so the scheduler resumes.
    wake = await sim.api.wake()
    assert (wake.status, wake.body) == (200, {"status": "awake", "tags": None})
    assert not await sim.api.is_sleeping()
    assert (await sim.state())["memory"]["used_bytes"] == OVERHEAD_ONLY
    answer = await sim.api.completion(max_tokens=4)  # the forward pass reads unmapped weights
    assert (answer.status, answer.body["error"]["message"]) == (500, ENGINE_DEAD_CLIENT_MESSAGE)
    kinds = [v["kind"] for v in sim.engine.violations]
    assert {"wake_up_while_worker_asleep", "generate_ran_while_asleep"} <= set(kinds)


async def test_a_sleep_sent_again_completes_the_one_that_answered_500(make_sim: SimFactory) -> None:
    """As AIBrix 0.8.0 re-sends it: the allocator skips what is already asleep, frees nothing more, the assertion holds
    and the executor records its sleeping tags; the wake then maps the memory back."""
    sim = await make_sim(vllm_version="0.34")
    await _freed_500(sim)
    assert (await sim.api.sleep(1)).status == 200
    assert (await sim.state())["asleep_tags"] == ["kv_cache", "weights"]
    assert (await sim.api.wake()).body == {"status": "awake", "tags": None}
    assert (await sim.state())["memory"]["used_bytes"] == 58 * GIB
    assert (await sim.api.completion(max_tokens=4)).status == 200
    assert sim.engine.violations == []


async def test_a_stall_accepts_and_runs_requests_that_produce_nothing_while_health_is_200(make_sim: SimFactory) -> None:
    sim = await make_sim(faults=("generate:stall:1.5",))
    result = StreamResult()
    stream = asyncio.create_task(sim.api.stream_completion(result, max_tokens=5))
    assert await still_pending(stream, window=0.3)
    assert result.chunks == []  # not a byte, the status line aside
    assert (await sim.api.get("/health")).status == 200
    assert await sim.api.server_load() == 1
    assert await sim.api.metric_sum("vllm:num_requests_running") == 1.0
    assert (await sim.state())["stalled"]
    await asyncio.wait_for(stream, 10)  # bytes flow again once the stall ends
    assert (result.done, result.finish_reason) == (True, "length")
