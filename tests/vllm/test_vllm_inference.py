"""Inference through the proxy is what vLLM gives directly (temperature 0), and disconnects abort."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.lifeguard_testing import listen_drops
from tests.vllm.vllm_e2e import (
    LONG,
    MODEL,
    get_json,
    lg_state,
    long_stream_body,
    metric,
    metrics,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

PROMPT = "def sleep(self, level):"
CHAT = [{"role": "user", "content": "hello proxy, wake the engine"}]


def _strip_ids(obj: Any) -> Any:
    """Drop what differs between two identical generations: ids and timestamps."""
    if isinstance(obj, dict):
        return {k: _strip_ids(v) for k, v in obj.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(obj, list):
        return [_strip_ids(v) for v in obj]
    return obj


async def test_completion_through_proxy_equals_direct(oai: AsyncOpenAI, oai_direct: AsyncOpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    direct = await oai_direct.completions.create(**kw)
    proxied = await oai.completions.create(**kw)
    assert direct.choices[0].text  # the model produced something, so equality means something
    assert _strip_ids(proxied.model_dump()) == _strip_ids(direct.model_dump())


async def test_chat_through_proxy_equals_direct(oai: AsyncOpenAI, oai_direct: AsyncOpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, logprobs=True)
    direct = await oai_direct.chat.completions.create(**kw)
    proxied = await oai.chat.completions.create(**kw)
    assert direct.choices[0].message.content
    assert _strip_ids(proxied.model_dump()) == _strip_ids(direct.model_dump())


async def _collect(stream: Any) -> list[dict[str, Any]]:
    return [_strip_ids(chunk.model_dump()) async for chunk in stream]


def _merge(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a stream says, independent of chunking: vLLM packs several tokens into one chunk when its
    reader lags (seen: 465 chunks for 480 tokens), so chunk boundaries may differ between two runs."""
    out: dict[str, Any] = {"objects": set(), "models": set(), "choices": {}, "usage": None}
    for c in chunks:
        out["objects"].add(c["object"])
        out["models"].add(c["model"])
        if c.get("usage"):
            out["usage"] = c["usage"]
        for ch in c["choices"]:
            m = out["choices"].setdefault(ch["index"], {"text": "", "role": None, "finish_reason": None})
            delta = ch.get("delta") or {}
            m["text"] += ch.get("text") or delta.get("content") or ""
            m["role"] = m["role"] or delta.get("role")
            m["finish_reason"] = ch.get("finish_reason") or m["finish_reason"]
    return out


#: The streamed requests' sampling: greedy, so that the proxy's stream and vLLM's compare; the usage chunk at the end.
STREAMED: dict[str, Any] = {
    "max_tokens": 32,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_streamed_completion_through_proxy_equals_direct(oai: AsyncOpenAI, oai_direct: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, **STREAMED}
    direct = _merge(await _collect(await oai_direct.completions.create(**kw)))
    proxied = _merge(await _collect(await oai.completions.create(**kw)))
    assert direct["usage"]["completion_tokens"] == 32 and direct["choices"][0]["text"]
    assert proxied == direct  # same text, finish reason, usage chunk at the end


async def test_streamed_chat_through_proxy_equals_direct(oai: AsyncOpenAI, oai_direct: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": CHAT, **STREAMED}
    direct = _merge(await _collect(await oai_direct.chat.completions.create(**kw)))
    proxied = _merge(await _collect(await oai.chat.completions.create(**kw)))
    assert direct["choices"][0]["role"] == "assistant" and direct["usage"]["completion_tokens"] == 32
    assert proxied == direct


async def test_raw_sse_framing_through_proxy_equals_direct(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    """Below the SDK: the SSE framing (content type, `data: ` events, blank-line separators, the final
    [DONE]) is relayed unchanged and carries the same generation."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}

    async def raw(base: str) -> tuple[str, str, dict[str, Any]]:
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            ctype = r.headers["Content-Type"]
            text = (await r.read()).decode()
        assert text.endswith("data: [DONE]\n\n"), text[-200:]
        events = text.split("\n\n")[:-1]
        assert all(e.startswith("data: ") and "\n" not in e for e in events), events
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        return ctype, events[-1], _merge([_strip_ids(c) for c in chunks])

    direct = await raw(vllm_server.url)
    proxied = await raw(proxy.url)
    assert direct[2]["choices"][0]["finish_reason"] == "length"
    assert proxied == direct


async def test_client_disconnect_through_proxy_aborts_generation_in_vllm(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    before = await metrics(session, vllm_server.url)
    gen0 = metric(before, "vllm:generation_tokens_total")
    seen = 0
    async with session.post(proxy.url + "/v1/completions", json=long_stream_body()) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                seen += 1
                if seen == 10:
                    break
        # leave the block without reading the rest: close the connection under the stream
        r.close()
    # vLLM notices through the proxy: nothing left in flight, long before the 480 tokens would end
    await wait_until(
        lambda: get_json(session, vllm_server.url + "/load"),
        lambda load: load["server_load"] == 0,
        timeout=10,
        what="vLLM /load back to 0 after the disconnect",
    )
    after = await metrics(session, vllm_server.url)
    generated = metric(after, "vllm:generation_tokens_total") - gen0
    assert generated < LONG - 100, f"vLLM generated {generated} of {LONG} tokens: the disconnect did not abort it"
    assert metric(after, "vllm:num_requests_running") == 0
    st = await wait_until(
        lambda: lg_state(session, proxy.url),
        lambda s: s["inflight_requests"] == 0,
        timeout=5,
        what="proxy inflight_requests back to 0",
    )
    assert st["state"] == "RUNNING"


async def test_concurrent_requests_through_proxy_all_complete(oai: AsyncOpenAI) -> None:
    prompts = [f"{PROMPT} # {i}" for i in range(8)]
    results = await asyncio.gather(
        *(oai.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts)
    )
    assert [r.usage.completion_tokens for r in results if r.usage] == [8] * 8
    assert all(r.choices[0].finish_reason == "length" for r in results)


async def test_a_burst_of_512_new_streams_is_all_delivered_and_vllm_turns_no_connect_away(proxy: Any) -> None:
    """The RL shape (issue 39): a batch of generations fired at once, each streamed. At its defaults the proxy opens
    as many connections to vLLM at once as the kernel lets vLLM's listen queue hold (proxy/upstream/pool.py,
    `default_max_connecting`); vLLM's own server takes them all: every stream ends with [DONE], and the kernel's
    count of connects that vLLM's listener (and the proxy's) turned away does not move."""
    listeners = {"vLLM": int(proxy.upstream.rsplit(":", 1)[1]), "the proxy": proxy.port}
    turned_away = {name: listen_drops(port) for name, port in listeners.items()}
    timeout = aiohttp.ClientTimeout(total=150, sock_connect=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as burst:

        async def stream(i: int) -> tuple[int, bytes]:
            body = {"model": MODEL, "prompt": f"{PROMPT} # {i}", "max_tokens": 2, "temperature": 0, "stream": True}
            async with burst.post(proxy.url + "/v1/completions", json=body) as r:
                return r.status, await r.read()

        async with asyncio.timeout(170):
            answers = await asyncio.gather(*(stream(i) for i in range(512)))
    done = b"data: [DONE]\n\n"
    broken = [(status, text[-120:]) for status, text in answers if status != 200 or not text.endswith(done)]
    assert not broken, f"{len(broken)} of 512 streams not delivered, e.g. {broken[:3]}"
    after = {name: listen_drops(port) for name, port in listeners.items()}
    assert after == turned_away, f"the kernel turned connects away (a full listen queue): {turned_away} -> {after}"
