"""vLLM 0.33: a user pause in abort or wait mode refuses new requests until the scheduler resumes; 0.32 queues them.

Read in the 0.33 wheel: `EngineCoreProc.pause_generation` sets `reject_new_requests = mode != "keep"`, and
`_reject_add_while_paused` ends every new request with `RequestError(code="engine_paused", retryable=True)`
(v1/engine/core.py); `create_error_response` makes that a 503 `ServiceUnavailableError` (the code itself never
reaches the client). A stream has already answered 200 and gets the error as its only event, then `[DONE]`
(openai/completion/serving.py, openai/chat_completion/serving.py). `resume_scheduler` (a /resume, or a /wake_up that
leaves nothing asleep) takes the flag back; /sleep pauses the scheduler without touching it. The bytes below are
what those code paths write: starlette's JSONResponse is compact, the completions stream uses json.dumps' default
separators, the chat stream pydantic's compact dump with the type it passes ("InternalServerError", code 503).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conformance.api import Answer, VllmApi, engine_holds_one, still_pending
from tests.conformance.conftest import on_profiles

pytestmark = on_profiles("0.32", "0.33", "0.34")

PAUSED_BODY = (
    b'{"error":{"message":"Generation is paused. Please retry after it resumes.",'
    b'"type":"ServiceUnavailableError","param":null,"code":503}}'
)
COMPLETION_STREAM = (
    b'data: {"error": {"message": "Generation is paused. Please retry after it resumes.", '
    b'"type": "ServiceUnavailableError", "param": null, "code": 503}}\n\n'
    b"data: [DONE]\n\n"
)
CHAT_STREAM = (
    b'data: {"error":{"message":"Generation is paused. Please retry after it resumes.",'
    b'"type":"InternalServerError","param":null,"code":503}}\n\n'
    b"data: [DONE]\n\n"
)


async def _raw(vllm: VllmApi, path: str, body: dict[str, object]) -> tuple[int, str, bytes]:
    async with vllm.session.post(vllm.base + path, json=body, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def _completion(vllm: VllmApi, **extra: object) -> dict[str, object]:
    return {"model": vllm.model, "prompt": "Count upward slowly:", "max_tokens": 4, "temperature": 0, **extra}


def _chat(vllm: VllmApi, **extra: object) -> dict[str, object]:
    return {"model": vllm.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


async def _served_after_resume(vllm: VllmApi, request: asyncio.Task[Answer]) -> None:
    """Queued by the paused engine, and answered with a completion once it resumes (not an error it ended with)."""
    await engine_holds_one(vllm)
    assert await still_pending(request)
    assert (await vllm.post("/resume")).status == 200
    answer = await asyncio.wait_for(request, 30)
    assert answer.status == 200, answer.text
    assert answer.body["choices"][0]["finish_reason"] in ("length", "stop"), answer.body  # generated, not aborted


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_a_request_sent_during_a_pause_is_refused_503_on_033_and_held_on_032(
    vllm: VllmApi, vllm_version: str, mode: str
) -> None:
    assert (await vllm.post("/pause", mode=mode)).status == 200
    if vllm_version == "0.32":
        await _served_after_resume(vllm, asyncio.create_task(vllm.completion(max_tokens=4)))
        return
    status, content_type, body = await _raw(vllm, "/v1/completions", _completion(vllm))
    assert (status, body) == (503, PAUSED_BODY)
    assert content_type.startswith("application/json")
    assert await vllm.server_load() == 0  # refused on arrival: nothing was queued
    assert (await vllm.post("/resume")).status == 200
    assert (await vllm.completion(max_tokens=4)).status == 200  # the resume took the refusal back


async def test_a_stream_sent_during_a_pause_answers_200_then_the_error_event_and_done(
    vllm: VllmApi, vllm_version: str
) -> None:
    if vllm_version == "0.32":
        pytest.skip("vLLM 0.32 queues the request (test_a_request_sent_during_a_pause_is_refused_503_on_033...)")
    await vllm.post("/pause", mode="abort")
    status, content_type, body = await _raw(vllm, "/v1/completions", _completion(vllm, stream=True))
    assert (status, body) == (200, COMPLETION_STREAM)
    assert content_type.startswith("text/event-stream")
    status, content_type, body = await _raw(vllm, "/v1/chat/completions", _chat(vllm, stream=True))
    assert (status, body) == (200, CHAT_STREAM)


async def test_a_chat_request_sent_during_a_pause_is_refused_like_a_completion(
    vllm: VllmApi, vllm_version: str
) -> None:
    if vllm_version == "0.32":
        pytest.skip("vLLM 0.32 queues the request")
    await vllm.post("/pause", mode="wait")
    status, content_type, body = await _raw(vllm, "/v1/chat/completions", _chat(vllm))
    assert (status, body) == (503, PAUSED_BODY)
    assert content_type.startswith("application/json")


async def test_keep_mode_still_queues_on_every_release(vllm: VllmApi) -> None:
    await vllm.post("/pause", mode="keep")
    await _served_after_resume(vllm, asyncio.create_task(vllm.completion(max_tokens=4)))


async def test_a_wake_up_takes_the_refusal_back(vllm: VllmApi) -> None:
    await vllm.post("/pause", mode="abort")
    assert (await vllm.wake()).status == 200  # resume_scheduler: the pause and its refusal both end
    assert (await vllm.completion(max_tokens=4)).status == 200


async def test_a_sleep_after_the_pause_keeps_refusing_until_the_wake(vllm: VllmApi, vllm_version: str) -> None:
    """sleep() pauses the scheduler (pause_scheduler) without touching reject_new_requests: set by the pause, it
    stays through the sleep, and the wake's resume_scheduler takes it back."""
    await vllm.post("/pause", mode="abort")
    await vllm.sleep(1)
    if vllm_version == "0.32":
        request = asyncio.create_task(vllm.completion(max_tokens=4))

        await engine_holds_one(vllm)
        await vllm.wake()
        assert (await asyncio.wait_for(request, 30)).status == 200
        return
    status, _, body = await _raw(vllm, "/v1/completions", _completion(vllm))
    assert (status, body) == (503, PAUSED_BODY)
    await vllm.wake()
    assert (await vllm.completion(max_tokens=4)).status == 200


async def test_a_sleep_alone_queues_on_every_release(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    request = asyncio.create_task(vllm.completion(max_tokens=4))

    await engine_holds_one(vllm)
    assert await still_pending(request)
    await vllm.wake()
    assert (await asyncio.wait_for(request, 30)).status == 200
