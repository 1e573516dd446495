"""Weight versions on the real vLLM-for-CPU 0.32, which gives no spans (docs/guides/weight-versions.md, class 32).

A greedy stream that asked for `weight_versions` runs through the lifeguard; `/pause?mode=keep`, the model's file
changed on disk and `collective_rpc reload_weights`, `/resume`. The spans the proxy made split the stream's tokens at
one place, and the tokens before it are the old weights' own greedy answer (sent alone, directly, before the change),
those from it on not: the new weights began exactly where the proxy says. Each answer carries the header.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm.test_vllm_prefix_cache import _change_weights, _from_an_empty_cache
from tests.vllm.vllm_e2e import MODEL, StreamReader, post, under_way

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

TOKENS = 160
BODY = {"model": MODEL, "prompt": "Count upward slowly: one, two, three,", "max_tokens": TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def _token_ids(stream: StreamReader) -> list[int]:
    return [token for chunk in stream.chunks for token in chunk["choices"][0].get("token_ids") or []]


async def test_a_stream_across_a_keep_mode_reload_is_split_where_the_new_weights_began(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    vllm, base = vllm_server.url, proxy.url
    weights = Path(os.environ["LIFEGUARD_VLLM_MODEL"]) / "model.safetensors"
    async with _from_an_empty_cache(session, vllm, weights):
        status, old, _ = await post(session, vllm + "/v1/completions", json=BODY)
        assert status == 200, old
        old_ids = old["choices"][0]["token_ids"]
        stream = StreamReader()
        task = asyncio.ensure_future(
            stream.run(session, base + "/v1/completions", {**BODY, "stream": True, "return_weight_versions": True})
        )
        await under_way(session, vllm, stream)
        assert (await post(session, base + "/pause?mode=keep"))[0] == 200
        _change_weights(weights)
        status, body, _ = await post(session, base + "/collective_rpc", json={"method": "reload_weights"})
        assert status == 200, body
        assert (await post(session, base + "/resume"))[0] == 200
        await asyncio.wait_for(task, 180)
    ids = _token_ids(stream)
    assert stream.status == 200 and len(ids) == TOKENS and "usage" not in stream.events[-2], stream.timing()
    spans = stream.chunks[-1]["choices"][0]["weight_versions"]
    assert [span["version"] for span in spans] == ["lifeguard-0", "lifeguard-1"], spans
    split = spans[0]["end"]
    assert spans == [
        {"version": "lifeguard-0", "start": 0, "end": split},
        {"version": "lifeguard-1", "start": split, "end": TOKENS},
    ]
    assert 0 < split < TOKENS
    assert ids[:split] == old_ids[:split]  # the old weights' own tokens, up to the split
    assert ids[split:] != old_ids[split:TOKENS]  # from it on, other weights'
