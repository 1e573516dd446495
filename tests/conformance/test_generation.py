"""OpenAI routes: completions and chat, streamed and not, with usage and logprobs."""

from __future__ import annotations

import json

from tests.conformance.api import StreamResult, VllmApi


async def test_completion_has_the_openai_shape(vllm: VllmApi) -> None:
    answer = await vllm.completion(max_tokens=8, ignore_eos=True)
    assert answer.status == 200
    body = answer.body
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == vllm.model
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


async def test_greedy_completion_is_deterministic(vllm: VllmApi) -> None:
    first = await vllm.completion(prompt="The river", max_tokens=6, ignore_eos=True)
    second = await vllm.completion(prompt="The river", max_tokens=6, ignore_eos=True)
    assert first.body["choices"][0]["text"] == second.body["choices"][0]["text"]


async def test_completion_logprobs_align_with_tokens(vllm: VllmApi) -> None:
    answer = await vllm.completion(max_tokens=5, logprobs=2, ignore_eos=True)
    logprobs = answer.body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"])


async def test_chat_completion_has_the_openai_shape(vllm: VllmApi) -> None:
    body = {"model": vllm.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    answer = await vllm.call("POST", "/v1/chat/completions", json_body=body)
    assert answer.status == 200
    assert answer.body["object"] == "chat.completion"
    (choice,) = answer.body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert answer.body["usage"]["completion_tokens"] <= 6


async def test_stream_ends_with_finish_reason_then_done(vllm: VllmApi) -> None:
    result = await vllm.stream_completion(StreamResult(), max_tokens=6)
    assert result.status == 200
    assert result.done
    assert result.finish_reason == "length"
    assert all(chunk["object"] == "text_completion" for chunk in result.chunks)


async def test_stream_usage_comes_last_with_empty_choices(vllm: VllmApi) -> None:
    result = await vllm.stream_completion(StreamResult(), max_tokens=4, stream_options={"include_usage": True})
    last = result.chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4


async def test_chat_stream_opens_with_the_assistant_role(vllm: VllmApi) -> None:
    body = {
        "model": vllm.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    async with vllm.session.post(vllm.base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() async for line in resp.content]
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"


async def test_unknown_model_is_404(vllm: VllmApi) -> None:
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}
    answer = await vllm.call("POST", "/v1/completions", json_body=body)
    assert answer.status == 404
    assert answer.body["error"]["code"] == 404


async def test_generation_moves_the_metrics(vllm: VllmApi) -> None:
    tokens_before = await vllm.metric_sum("vllm:generation_tokens_total")
    length_before = await vllm.metric_sum("vllm:request_success_total", finished_reason="length")
    await vllm.completion(max_tokens=5, ignore_eos=True)
    assert await vllm.metric_sum("vllm:generation_tokens_total") >= tokens_before + 5
    assert await vllm.metric_sum("vllm:request_success_total", finished_reason="length") == length_before + 1
