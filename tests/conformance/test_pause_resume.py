"""/pause, /resume, /is_paused, /abort_requests: bodies, validation, idempotency, cross-effects."""

from __future__ import annotations

import pytest

from tests.conformance.api import VllmApi


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_pause_and_resume_are_idempotent(vllm: VllmApi, mode: str) -> None:
    for _ in range(2):
        answer = await vllm.post("/pause", mode=mode)
        assert (answer.status, answer.body) == (200, {"status": "paused"})
    assert await vllm.is_paused()
    for _ in range(2):
        answer = await vllm.post("/resume")
        assert (answer.status, answer.body) == (200, {"status": "resumed"})
    assert not await vllm.is_paused()


async def test_resume_on_a_running_engine_answers_200(vllm: VllmApi) -> None:
    answer = await vllm.post("/resume")
    assert (answer.status, answer.body) == (200, {"status": "resumed"})


async def test_pause_also_reads_as_sleeping(vllm: VllmApi) -> None:
    await vllm.post("/pause")
    assert await vllm.is_sleeping()


@pytest.mark.parametrize("paused", [False, True])
async def test_pause_with_an_unknown_mode_is_400_and_keeps_state(vllm: VllmApi, paused: bool) -> None:
    if paused:
        await vllm.post("/pause")
    answer = await vllm.post("/pause", mode="invalid")
    assert answer.status == 400
    assert answer.body["error"]["param"] == "query.mode"
    assert await vllm.is_paused() == paused


async def test_wake_up_lifts_a_pause(vllm: VllmApi) -> None:
    await vllm.post("/pause")
    answer = await vllm.wake()
    assert (answer.status, answer.body) == (200, {"status": "awake", "tags": None})
    assert not await vllm.is_paused()


async def test_wake_up_after_pause_then_sleep_also_unpauses(vllm: VllmApi) -> None:
    await vllm.post("/pause")
    await vllm.sleep(1)
    await vllm.wake()
    assert not await vllm.is_paused()
    assert not await vllm.is_sleeping()


async def test_abort_requests_needs_a_json_body(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/abort_requests", data=b"")
    assert answer.status == 400


async def test_abort_requests_with_nothing_running_aborts_nothing(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/abort_requests", json_body={})
    assert answer.status == 200
    assert answer.body["aborted"] == 0
