"""Weight-version spans: which weights (by their label) sampled each output token.

Read in the wheels: the engine core attaches its label (`"default"` until `/finish_weight_update {"weight_version"}` or
`/update_weight_version` sets one) to every step's outputs (`EngineCore._attach_weight_version`, v1/engine/core.py),
and the output processor opens a span each time the label differs from the last token's
(`RequestState.track_weight_version`, v1/engine/output_processor.py), giving the finished output
`weight_versions: [{version, start, end}]` (`WeightVersionSpan`, vllm/outputs.py). Every release since 0.32 returns them
on `/inference/v1/generate` (scale_out/token_in_token_out/serving.py); 0.33 adds `return_weight_versions` to completion
and chat requests (openai/*/protocol.py), the spans on each choice, null when not asked for (`model_dump()`), and on a
stream the spans on the finishing chunk only: the completion generator writes the field, null, on every chunk, the chat
generator on its finishing chunk only (openai/*/serving.py, dumped with `exclude_unset`). 0.32 ignores the request field
(`OpenAIBaseModel` has `extra="allow"`) and has no such key.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.conformance.api import StreamResult, VllmApi, engine_holds_one, settled_chunks


def _spans(version: str, end: int) -> list[dict[str, Any]]:
    return [{"version": version, "start": 0, "end": end}]


def _chat(vllm: VllmApi, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": vllm.model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _sse(vllm: VllmApi, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with vllm.session.post(vllm.base + path, json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


async def test_a_completion_that_asks_gets_one_span_per_choice_on_033_and_nothing_on_032(
    vllm: VllmApi, vllm_version: str
) -> None:
    answer = await vllm.completion(max_tokens=6, ignore_eos=True, return_weight_versions=True)
    assert answer.status == 200  # 0.32 ignores the field it does not know
    choice = answer.body["choices"][0]
    if vllm_version == "0.32":
        assert "weight_versions" not in choice
        return
    assert choice["weight_versions"] == _spans("default", answer.body["usage"]["completion_tokens"])


async def test_the_spans_are_null_unless_asked_for(vllm: VllmApi, vllm_version: str) -> None:
    completion = (await vllm.completion(max_tokens=3)).body["choices"][0]
    chat = (await vllm.call("POST", "/v1/chat/completions", json_body=_chat(vllm, 3))).body["choices"][0]
    for choice in (completion, chat):
        if vllm_version == "0.32":
            assert "weight_versions" not in choice
        else:
            assert "weight_versions" in choice and choice["weight_versions"] is None


async def test_the_label_is_the_one_last_set_even_without_a_weight_change(vllm: VllmApi, vllm_version: str) -> None:
    relabel = await vllm.call("POST", "/update_weight_version", json_body={"new_version": "step-7"})
    assert (relabel.status, relabel.body) == (200, {"success": True, "new_version": "step-7"})
    assert (await vllm.get("/weight_info")).body == {"weight_version": "step-7"}
    answer = await vllm.call("POST", "/v1/chat/completions", json_body=_chat(vllm, 4, return_weight_versions=True))
    if vllm_version != "0.32":
        assert answer.body["choices"][0]["weight_versions"] == _spans(
            "step-7", answer.body["usage"]["completion_tokens"]
        )
    await vllm.call("POST", "/update_weight_version", json_body={"new_version": "default"})


async def test_a_request_ended_before_its_first_token_has_no_span(vllm: VllmApi, vllm_version: str) -> None:
    assert (await vllm.post("/pause", mode="keep")).status == 200
    request = asyncio.create_task(vllm.completion(max_tokens=4, return_weight_versions=True))
    await engine_holds_one(vllm)
    assert (await vllm.call("POST", "/abort_requests", json_body={})).status == 200
    choice = (await asyncio.wait_for(request, 30)).body["choices"][0]
    assert choice["finish_reason"] == "abort"
    if vllm_version != "0.32":
        assert choice["weight_versions"] == []  # no token, no span (vllm/v1/engine/output_processor.py)
    assert (await vllm.post("/resume")).status == 200


async def test_a_completion_stream_writes_null_spans_until_the_finishing_chunk(
    vllm: VllmApi, vllm_version: str
) -> None:
    body = {"model": vllm.model, "prompt": "Count:", "max_tokens": 5, "ignore_eos": True, "stream": True}
    chunks = await _sse(vllm, "/v1/completions", {**body, "return_weight_versions": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if vllm_version == "0.32":
        assert all("weight_versions" not in ch for ch in choices)
        return
    assert [ch["weight_versions"] for ch in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    assert choices[-1]["weight_versions"] == _spans("default", 5)


async def test_a_chat_stream_writes_the_spans_on_its_finishing_chunk_only(vllm: VllmApi, vllm_version: str) -> None:
    body = _chat(vllm, 4, stream=True, return_weight_versions=True)
    choices = [c["choices"][0] for c in await _sse(vllm, "/v1/chat/completions", body) if c["choices"]]
    if vllm_version == "0.32":
        assert all("weight_versions" not in ch for ch in choices)
        return
    assert all("weight_versions" not in ch for ch in choices[:-1])
    assert choices[-1]["weight_versions"] == _spans("default", 4)


async def test_a_relabel_while_a_stream_is_frozen_splits_its_span_where_the_label_changed(
    vllm: VllmApi, vllm_version: str
) -> None:
    if vllm_version == "0.32":
        return  # no spans on completions; /inference/v1/generate does not stream here
    result = StreamResult()
    stream = asyncio.create_task(vllm.stream_completion(result, max_tokens=150, return_weight_versions=True))
    await asyncio.wait_for(result.first_text.wait(), 30)
    assert (await vllm.post("/pause", mode="keep")).status == 200
    before = await settled_chunks(result)
    assert (await vllm.call("POST", "/update_weight_version", json_body={"new_version": "v2"})).status == 200
    assert (await vllm.post("/resume")).status == 200
    await asyncio.wait_for(stream, 60)
    final = [c["choices"][0] for c in result.chunks if c["choices"]][-1]
    assert final["weight_versions"] == [
        {"version": "default", "start": 0, "end": before},
        {"version": "v2", "start": before, "end": 150},
    ]
    await vllm.call("POST", "/update_weight_version", json_body={"new_version": "default"})


async def test_generate_carries_the_spans_in_every_release(vllm: VllmApi) -> None:
    """0.32 included: scale_out/token_in_token_out/serving.py copies `output.weight_versions` on every choice."""
    ids = (await vllm.call("POST", "/tokenize", json_body={"prompt": "Count upward slowly:"})).body["tokens"]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    answer = await vllm.call("POST", "/inference/v1/generate", json_body=body)
    assert answer.status == 200, answer.text
    assert answer.body["choices"][0]["weight_versions"] == _spans("default", answer.body["usage"]["completion_tokens"])


async def test_a_label_must_be_a_string(vllm: VllmApi) -> None:
    """FastAPI's `Annotated[str, Body(embed=True)]` (rl/online/api_router.py): 400 naming the body field."""
    missing = await vllm.call("POST", "/update_weight_version", json_body={})
    assert (missing.status, missing.body["error"]["param"]) == (400, "body.new_version")
    number = await vllm.call("POST", "/update_weight_version", json_body={"new_version": 7})
    assert (number.status, number.body["error"]["param"]) == (400, "body.new_version")
    assert (await vllm.get("/weight_info")).body == {"weight_version": "default"}
