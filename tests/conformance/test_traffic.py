"""What happens to requests per state: held, aborted, frozen, drained (measured on vLLM 0.32: docs/real-vllm.md)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.api import StreamResult, VllmApi, engine_holds_one, eventually, settled_chunks, still_pending
from tests.lifeguard_testing import stream_under_way


async def _under_way(vllm: VllmApi, result: StreamResult) -> None:
    """The long stream has reached the engine (lifeguard_testing.stream_under_way)."""
    await stream_under_way(engine_holds_one(vllm), result.first_text, load="GET /load")


async def test_request_sent_while_asleep_is_held_until_wake(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert await still_pending(request)
    assert (await vllm.get("/health")).status == 200
    await vllm.wake()
    answer = await asyncio.wait_for(request, 30)
    assert answer.status == 200
    assert answer.body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_request_held_through_a_partial_wake_completes_after_the_last_tag(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    await vllm.wake("weights")
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert await still_pending(request)
    await vllm.wake("kv_cache")
    assert (await asyncio.wait_for(request, 30)).status == 200


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_request_sent_while_paused_is_held_until_resume(vllm: VllmApi, vllm_version: str, mode: str) -> None:
    await vllm.post("/pause", mode=mode)
    if vllm_version != "0.32" and mode != "keep":
        # vLLM 0.33 refuses it instead (test_pause_refusal.py has the exact answers)
        assert (await vllm.completion(max_tokens=4)).status == 503
        return
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert await still_pending(request)
    await vllm.post("/resume")
    assert (await asyncio.wait_for(request, 30)).status == 200


async def test_sleep_aborts_an_inflight_stream(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result))
    await _under_way(vllm, result)
    assert (await vllm.sleep(1)).status == 200
    await asyncio.wait_for(stream, 30)
    assert result.status == 200
    assert result.done
    assert result.finish_reason == "abort"


async def test_sleep_in_wait_mode_returns_after_the_stream_finished(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result, max_tokens=60))
    await asyncio.wait_for(result.first_text.wait(), 30)
    assert (await vllm.sleep(1, mode="wait")).status == 200
    await asyncio.wait_for(stream, 30)  # its end can reach us late from a real vLLM short of CPU
    assert result.finish_reason == "length"
    assert await vllm.is_sleeping()


async def test_repeated_sleep_aborts_requests_queued_during_sleep(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert (await vllm.sleep(1)).status == 200
    answer = await asyncio.wait_for(request, 30)
    assert answer.status == 200
    assert answer.body["choices"][0]["finish_reason"] == "abort"


async def test_pause_aborts_an_inflight_stream(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result))
    await _under_way(vllm, result)
    assert (await vllm.post("/pause")).status == 200
    await asyncio.wait_for(stream, 30)
    assert (result.status, result.done, result.finish_reason) == (200, True, "abort")


async def test_pause_in_wait_mode_returns_after_the_stream_finished(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result, max_tokens=60))
    await asyncio.wait_for(result.first_text.wait(), 30)
    assert (await vllm.post("/pause", mode="wait")).status == 200
    await asyncio.wait_for(stream, 30)  # its end can reach us late from a real vLLM short of CPU
    assert result.finish_reason == "length"


async def test_pause_in_keep_mode_freezes_the_stream_until_resume(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result))
    await _under_way(vllm, result)
    assert (await vllm.post("/pause", mode="keep")).status == 200
    frozen_at = await settled_chunks(result)  # chunks already on the wire have arrived; now nothing may move
    assert await still_pending(stream, window=1.0)
    assert result.text_chunks == frozen_at
    await vllm.post("/resume")

    async def moving() -> bool:
        return result.text_chunks > frozen_at

    await eventually(moving, what="the stream to move again after /resume")
    await vllm.post("/pause")  # abort mode ends the long stream here instead of waiting it out
    await asyncio.wait_for(stream, 30)
    assert result.finish_reason == "abort"
    await vllm.post("/resume")


async def test_resume_while_asleep_serves_the_held_request(vllm: VllmApi) -> None:
    """vLLM's hazard (EngineCore.resume_scheduler checks no sleep): /resume un-pauses a sleeping engine."""
    await vllm.sleep(1)
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert (await vllm.post("/resume")).status == 200
    assert (await asyncio.wait_for(request, 30)).status == 200
    assert await vllm.is_sleeping()


async def test_abort_requests_ends_a_held_request(vllm: VllmApi) -> None:
    await vllm.post("/pause", mode="keep")  # queued on every release (0.33 refuses new requests in the other modes)
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    answer = await vllm.call("POST", "/abort_requests", json_body={})
    assert answer.status == 200
    assert answer.body["aborted"] >= 1
    done = await asyncio.wait_for(request, 30)
    assert done.body["choices"][0]["finish_reason"] == "abort"


async def test_metrics_count_running_requests(vllm: VllmApi) -> None:
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result))
    await _under_way(vllm, result)

    async def running() -> bool:
        return await vllm.metric_sum("vllm:num_requests_running") >= 1

    # vLLM's API server updates its gauges after it hands the outputs on (AsyncLLM.output_handler), and a real
    # vLLM short of CPU does so late: the client can see tokens, and the end of an aborted stream, first.
    await eventually(running, timeout=30, what="num_requests_running >= 1")
    await vllm.post("/pause")
    await asyncio.wait_for(stream, 30)

    async def abort_counted() -> bool:
        return await vllm.metric_sum("vllm:request_success_total", finished_reason="abort") >= 1

    await eventually(abort_counted, timeout=30, what='request_success_total{finished_reason="abort"} >= 1')
