"""No request admitted after a weight change is served from prefix-cache blocks computed before it (issue 36).

The simulator keeps a prefix cache keyed like vLLM's (lifeguard_sim/prefix_cache.py): a request that reuses blocks
of older weights answers as those weights would, and the engine records `prefix_cache_stale_hit`. Direct, the
fully-async order (pause keep, a weight update, a reset answered `{"success": false}`, resume) gives that stale
answer; through the proxy it does not, whatever the trainer's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientTimeout

from lifeguard_sim.app import SimSettings
from lifeguard_sim.textgen import Quality, TokenStream
from tests.e2e.conftest import FAST_SIM, Stack

# 12 words a block of 16 tokens or more: the prompt's first blocks are cached by its first answer.
PREFIX = "You are a careful assistant. Answer each question in one short sentence, and no more. " * 3
PROMPT = PREFIX + "Question: what is the capital of France?"
SIM = SimSettings(**{**FAST_SIM.__dict__, "token_seconds": 0.005})
DEADLINE = ClientTimeout(total=20)


def _stale_hits(stack: Stack) -> list[dict[str, object]]:
    return [v for v in stack.sim.violations if v["kind"] == "prefix_cache_stale_hit"]


def _fresh_answer(stack: Stack, prompt: str, tokens: int) -> str:
    """What the engine's current weights answer for `prompt` with an empty cache (the simulator's own text rule)."""
    stream = TokenStream(stack.sim.model_seed("tiny"), prompt)
    return "".join(stream.next(Quality.NORMAL).text for _ in range(tokens))


def _base(server: Any) -> str:
    """The URL of the proxy (`stack.client`) or of the simulator (`stack.sim_server`), for a session of our own."""
    return str(server.make_url("")).rstrip("/")


async def _ask(stack: Stack) -> str:
    """PROMPT's answer through the proxy (greedy, 6 tokens)."""
    return await _text(await stack.completion(PROMPT, max_tokens=6))


def _assert_new_weights(stack: Stack, answer: str, *, old: str) -> None:
    """`answer` is the current weights' answer to PROMPT with an empty cache, not `old`; no prefix-cache stale hit."""
    assert answer == _fresh_answer(stack, PROMPT, 6) != old
    assert _stale_hits(stack) == []


@pytest.fixture
async def stack(make_stack: Any) -> Stack:
    """The proxy in front of a simulator whose answers take a few milliseconds a token."""
    stack: Stack = await make_stack(SIM)
    return stack


async def _text(resp: aiohttp.ClientResponse) -> str:
    assert resp.status == 200, await resp.text()
    return str((await resp.json())["choices"][0]["text"])


@contextlib.asynccontextmanager
async def _kept_stream(stack: Stack, session: aiohttp.ClientSession, base: str) -> AsyncIterator[None]:
    """A long stream sent to `base`, running in the engine for the block (its blocks held), then its client gone."""
    body = {"model": "tiny", "prompt": "a long rollout", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    stream = await session.post(f"{base}/v1/completions", json=body, timeout=DEADLINE)
    try:
        deadline = time.monotonic() + 10
        while stack.sim.scheduler.running < 1:
            assert time.monotonic() < deadline, "the long stream never ran"
            await asyncio.sleep(0.01)
        yield
    finally:
        stream.close()


UPDATE = {"/start_weight_update": {}, "/update_weights": {"update_info": {}}, "/finish_weight_update": {}}
SYNC = {"/pause?mode=keep&clear_cache=false": None, **UPDATE}


async def _fully_async_sync(
    session: aiohttp.ClientSession, base: str, *, reset: bool = True
) -> aiohttp.ClientResponse | None:
    """SkyRL 0.4.0's and TRL's order: pause keep, the weight update's phases, the prefix cache's reset, resume."""
    for path, body in SYNC.items():
        resp = await session.post(base + path, json=body, timeout=DEADLINE)
        assert resp.status == 200, (path, await resp.text())
    answer = await session.post(base + "/reset_prefix_cache", timeout=DEADLINE) if reset else None
    resumed = await session.post(base + "/resume", timeout=DEADLINE)
    assert resumed.status == 200, await resumed.text()
    return answer


async def test_direct_the_fully_async_order_serves_the_old_weights_prefix(stack: Stack) -> None:
    """The simulator reproduces vLLM: the reset fails while the kept stream holds blocks, and the cached prompt is
    answered from them (what tests/vllm/test_vllm_prefix_cache.py shows on the real vLLM-for-CPU)."""
    base = _base(stack.sim_server)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        before = await _text(await session.post(f"{base}/v1/completions", json=body, timeout=DEADLINE))
        async with _kept_stream(stack, session, base):
            reset = await _fully_async_sync(session, base)
            assert reset is not None and reset.status == 200 and await reset.json() == {"success": False}
            after = await _text(await session.post(f"{base}/v1/completions", json=body, timeout=DEADLINE))
    assert after == before != _fresh_answer(stack, PROMPT, 6)  # the old weights' answer, after the new weights
    assert len(_stale_hits(stack)) == 1


async def test_through_the_proxy_a_failed_reset_partitions_the_cache_until_one_succeeds(stack: Stack) -> None:
    base = _base(stack.client)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        before = await _ask(stack)
        async with _kept_stream(stack, session, base):
            reset = await _fully_async_sync(session, base)
            assert reset is not None and reset.status == 200
            # vLLM's own body, and the truth beside it: old-weight blocks remain, new requests cannot reach them.
            assert await reset.json() == {"success": False}
            assert reset.headers["X-Lifeguard-Prefix-Cache"] == "partitioned"
            state = await stack.state()
            assert state["prefix_cache"]["partitioned"] and state["prefix_cache"]["reason"] == (
                "a weight update session finished"
            )
            after = await _ask(stack)
            _assert_new_weights(stack, after, old=before)
            again = await _ask(stack)
            assert again == after  # requests after the change still share their own prefix
    # Once nothing is in flight, the reconcile loop's reset succeeds: requests go out as the client sent them.
    await stack.wait_for(lambda s: not s["prefix_cache"]["partitioned"], timeout=10)
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_prefix_cache_partitioned{engine="default"} 0.0' in metrics
    assert 'lifeguard_prefix_cache_resets_total{by="client",engine="default",result="not_cleared"} 1.0' in metrics
    # One at the start-up round (a new proxy cannot tell which weights filled the cache), one here.
    assert 'lifeguard_prefix_cache_resets_total{by="proxy",engine="default",result="cleared"} 2.0' in metrics
    assert await _ask(stack) == after
    assert _stale_hits(stack) == []


async def test_a_forgotten_reset_is_made_by_the_proxy(stack: Stack) -> None:
    base = _base(stack.client)
    before = await _ask(stack)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        assert await _fully_async_sync(session, base, reset=False) is None
    assert stack.sim_count("reset_prefix_cache") == 1  # the proxy's own, once the session finished: it succeeded
    state = await stack.state()
    assert not state["prefix_cache"]["partitioned"]
    after = await _ask(stack)
    _assert_new_weights(stack, after, old=before)


async def test_a_reload_through_collective_rpc_counts_as_a_weight_change(stack: Stack) -> None:
    base = _base(stack.client)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        await _ask(stack)
        async with _kept_stream(stack, session, base):
            for path, body in UPDATE.items():
                assert (await session.post(base + path, json=body, timeout=DEADLINE)).status == 200
            trained = await _ask(stack)
            reload = await session.post(base + "/collective_rpc", json={"method": "reload_weights"}, timeout=DEADLINE)
            assert reload.status == 200, await reload.text()
            state = await stack.state()
            assert state["prefix_cache"]["reason"] == "a reload through /collective_rpc (reload_weights)"
            checkpoint = await _ask(stack)
    _assert_new_weights(stack, checkpoint, old=trained)


async def test_a_client_salt_is_kept_apart_from_other_clients(stack: Stack) -> None:
    """Salted by the proxy, two tenants' salts still keep them apart, and a salt vLLM refuses is refused as before."""
    base = _base(stack.client)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        async with _kept_stream(stack, session, base):
            await _fully_async_sync(session, base)
            cached = len(stack.sim.prefix_cache)
            await _text(await stack.completion(PROMPT, max_tokens=2, cache_salt="tenant-a"))
            grown = len(stack.sim.prefix_cache)
            await _text(await stack.completion(PROMPT, max_tokens=2, cache_salt="tenant-b"))
            assert len(stack.sim.prefix_cache) - grown == grown - cached > 0  # no block shared between the two
            refused = await stack.completion(PROMPT, max_tokens=2, cache_salt="a/b")
            assert refused.status == 400 and "cache_salt" in (await refused.json())["error"]["message"]


async def test_a_restarted_proxy_keeps_the_partition(make_stack: Any, serve_lifeguard: Any, tmp_path: Any) -> None:
    stack: Stack = await make_stack(SIM, state_file=str(tmp_path / "state.json"))
    base, sim_base = _base(stack.client), _base(stack.sim_server)
    async with aiohttp.ClientSession(timeout=DEADLINE) as session:
        before = await _ask(stack)
        async with _kept_stream(stack, session, sim_base):  # sent to vLLM directly: it outlives the proxy
            await _fully_async_sync(session, base)
            salt = (await stack.state())["prefix_cache"]["salt"]
            await stack.client.close()
            client = await serve_lifeguard(stack.settings)
            deadline = time.monotonic() + 5
            while (state := await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
                assert time.monotonic() < deadline, f"the new proxy never adopted the engine: {state}"
                await asyncio.sleep(0.01)
            assert state["prefix_cache"]["partitioned"] and state["prefix_cache"]["salt"] == salt
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
            after = await _text(await client.post("/v1/completions", json=body))
    _assert_new_weights(stack, after, old=before)
