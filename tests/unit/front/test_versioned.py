"""What a forwarded answer says of its weights (proxy/front/versioned.py), on vLLM 0.32's own bytes: a lagging reader
gets several tokens in one chunk, and only vLLM's continuous usage counts them; the proxy asks for it and takes out
of the events what the client did not ask for."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from proxy.front.versioned import VersionStamp
from proxy.lifecycle.weight_version import WeightVersions
from proxy.observe.version_metrics import EngineVersionMetrics


def _versions() -> WeightVersions:
    metrics = SimpleNamespace(generation=lambda g: None, went_partial=lambda: None, relabel_unchanged=lambda: None)
    return WeightVersions(cast(EngineVersionMetrics, metrics), lambda: None)


def _event(text: str, completion_tokens: int | None, finish: str | None = None) -> bytes:
    """A chunk as vLLM 0.32's completion stream writes it (model_dump_json, exclude_unset)."""
    chunk: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
                             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                          "stop_reason": None}]}  # fmt: skip
    if completion_tokens is not None:
        chunk["usage"] = {
            "prompt_tokens": 3,
            "completion_tokens": completion_tokens,
            "total_tokens": 3 + completion_tokens,
        }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _events(data: bytes) -> list[Any]:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]" for line in data.split(b"\n\n") if line]


def test_a_stream_that_asked_is_sent_with_continuous_usage_and_the_client_sees_what_it_asked_for() -> None:
    versions = _versions()
    stamp = VersionStamp(versions, b'{"prompt":"a","stream":true,"return_weight_versions":true}')
    sent = json.loads(stamp.request_body(b'{"prompt":"a","stream":true,"return_weight_versions":true}'))
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}

    out = stamp.stream(_event(" one", 1) + _event(" two three", 3))  # a lagging reader: two tokens in one chunk
    versions.label_next("v2")
    versions.advanced("a session, while the stream was paused")
    out += stamp.stream(_event(" four", 4) + _event(" five", 5, finish="length"))
    usage_only = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}  # fmt: skip
    out += stamp.stream(b"data: " + json.dumps(usage_only).encode() + b"\n\ndata: [DONE]\n\n") + stamp.stream_end()

    events = _events(out)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])  # the client asked for none
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" one", " two three", " four", " five"]
    assert events[-2]["choices"][0]["weight_versions"] == [
        {"version": "lifeguard-0", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]


def test_a_client_that_asked_for_usage_keeps_it() -> None:
    body = b'{"stream":true,"return_weight_versions":true,"stream_options":{"include_usage":true}}'
    stamp = VersionStamp(_versions(), body)
    stamp.request_body(body)
    usage_only = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    out = stamp.stream(_event(" a b", 2, finish="length") + b"data: " + json.dumps(usage_only).encode() + b"\n\n")
    events = _events(out)
    assert "usage" not in events[0] and events[1]["usage"]["completion_tokens"] == 2  # continuous: not asked for


def test_a_request_that_did_not_ask_is_passed_through_as_it_came() -> None:
    stamp = VersionStamp(_versions(), b'{"prompt":"a","stream":true}')
    assert not stamp.asked
    data = _event(" x", None)
    assert stamp.stream(data) == data
