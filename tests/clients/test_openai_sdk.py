"""The openai SDK (the dev environment's `openai`, as eval harnesses and agent loops use it) through the
proxy: completions and chat, streamed and not; a request held across a sleep; the proxy's own errors
as the SDK reports them (status and message); and its retries waiting out the proxy's `Retry-After`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest

from tests.clients.conftest import MODEL, Stack
from tests.lifeguard_testing import client_timeout


def sdk(stack: Stack, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=max_retries, timeout=30)


async def _call(stack: Stack, path: str) -> int:
    """A lifecycle call to the proxy (an operator's POST, not the SDK's): its status."""
    async with (
        aiohttp.ClientSession(timeout=client_timeout()) as session,
        session.post(f"{stack.url}{path}") as response,
    ):
        return response.status


async def test_completions_and_chat_streamed_and_not(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    async with sdk(stack) as client:
        completion = await client.completions.create(model=MODEL, prompt="Count:", max_tokens=5)
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True
        )
        assert chat.choices[0].message.content and len(chat.choices[0].logprobs.content) == 5
        stream = await client.completions.create(model=MODEL, prompt="Count:", max_tokens=5, stream=True)
        assert "".join([chunk.choices[0].text async for chunk in stream if chunk.choices]) == completion.choices[0].text
        chat_stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        deltas = [chunk.choices[0].delta.content or "" async for chunk in chat_stream if chunk.choices]
        assert "".join(deltas) == chat.choices[0].message.content
    await stack.assert_clean()


async def test_a_request_during_sleep_is_answered_after_the_wake(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    async with sdk(stack) as client:
        assert await _call(stack, "/sleep?level=1") == 200
        held = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="Count:", max_tokens=4))
        await stack.wait_for(lambda s: s["held_requests"] == 1, "the SDK request to be held")
        assert await _call(stack, "/wake_up") == 200
        completion = await asyncio.wait_for(held, timeout=10)
    assert completion.choices[0].finish_reason == "length"
    await stack.assert_clean()


async def test_a_hold_timeout_is_a_503_with_the_proxys_message(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(hold_timeout_s=0.5)
    assert await _call(stack, "/sleep?level=1") == 200
    async with sdk(stack) as client:
        with pytest.raises(openai.APIStatusError) as raised:
            await client.completions.create(model=MODEL, prompt="Count:", max_tokens=4)
    assert raised.value.status_code == 503
    assert "not ready" in raised.value.message and raised.value.body["reason"] == "hold_timeout"
    assert stack.engine.state_dict()["violations"] == []


async def test_a_failed_engine_is_a_503_naming_it(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(sim={"faults": ("wake_up:lie-memory",)}, verify_timeout_s=1.0)
    assert await _call(stack, "/sleep?level=1") == 200
    assert await _call(stack, "/wake_up") == 503  # the wake's 200 was a lie: the memory never came back
    await stack.wait_for(lambda s: s["state"] == "FAILED", "FAILED")
    async with sdk(stack) as client:
        with pytest.raises(openai.APIStatusError) as raised:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 503
    assert "FAILED" in raised.value.message or "failed" in raised.value.message.lower()
    assert stack.engine.state_dict()["violations"] == []


async def test_the_sdks_retry_waits_out_retry_after(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(hold_timeout_s=0.3)
    assert await _call(stack, "/sleep?level=1") == 200
    arrivals: list[float] = []
    calls_before = len(stack.calls)

    async def watch() -> None:
        while True:
            new = [c for c in stack.calls[calls_before:] if c.startswith("POST /v1/completions")]
            while len(arrivals) < len(new):
                arrivals.append(time.monotonic())
            await asyncio.sleep(0.01)

    watcher = asyncio.ensure_future(watch())
    try:
        async with sdk(stack, max_retries=1) as client:
            with pytest.raises(openai.APIStatusError) as raised:
                await client.completions.create(model=MODEL, prompt="Count:", max_tokens=4)
    finally:
        watcher.cancel()
    retry_after = float(raised.value.response.headers["Retry-After"])
    assert len(arrivals) == 2, "one attempt and one retry"
    assert arrivals[1] - arrivals[0] >= 0.3 + retry_after * 0.9, "the SDK retried before Retry-After"


async def _json_call(stack: Stack, path: str, body: object) -> int:
    async with (
        aiohttp.ClientSession(timeout=client_timeout()) as session,
        session.post(f"{stack.url}{path}", json=body) as response,
    ):
        return response.status


@pytest.mark.parametrize("vllm_version", ["0.33", "0.32"])
async def test_the_sdk_reads_the_vouched_weight_version_from_the_header_and_the_spans(
    make_stack: Callable[..., Awaitable[Stack]], vllm_version: str
) -> None:
    """The SDK's own parsing (its SSE decoder, its models' extra fields) of what the proxy writes: vLLM 0.33's spans
    relabelled, vLLM 0.32's made by the proxy (docs/guides/weight-versions.md)."""
    stack = await make_stack(sim={"vllm_version": vllm_version})
    asked = {"extra_body": {"return_weight_versions": True, "ignore_eos": True}}
    async with sdk(stack) as client:
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt="Count:", max_tokens=4, **asked)
        assert raw.headers["x-lifeguard-weight-version"] == "lifeguard-0"
        spans = raw.parse().choices[0].model_extra["weight_versions"]
        assert spans == [{"version": "lifeguard-0", "start": 0, "end": 4}]
        for path, body in (("/start_weight_update", None), ("/update_weights", {"update_info": {}})):
            assert await _json_call(stack, path, body) == 200
        assert await _json_call(stack, "/finish_weight_update", {"weight_version": "step-1"}) == 200
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, **asked
        )
        finishing = [chunk.choices[0] async for chunk in stream if chunk.choices and chunk.choices[0].finish_reason]
        assert finishing[-1].model_extra["weight_versions"] == [{"version": "step-1", "start": 0, "end": 5}]
    await stack.assert_clean()
