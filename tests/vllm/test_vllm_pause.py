"""Pause and resume through the proxy: vLLM's own test_pause_resume.py, replayed step by step
(tests/entrypoints/serve/dev/rlhf/state_transitions/test_pause_resume.py in vLLM's repository)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.vllm.vllm_e2e import (
    LONG,
    MODEL,
    StreamReader,
    engine_never_saw_it,
    get_json,
    lg_state,
    long_stream_body,
    post,
    short_completion_body,
    under_way,
    wait_held,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


@pytest.fixture
async def resumed(proxy: Any, session: aiohttp.ClientSession) -> AsyncIterator[Any]:
    """vLLM's autouse fixture: POST /resume is 200 before and after every test."""
    assert (await post(session, proxy.url + "/resume"))[0] == 200
    yield proxy
    assert (await post(session, proxy.url + "/resume"))[0] == 200


async def pause(s: aiohttp.ClientSession, base: str, mode: str = "abort", clear_cache: bool = True) -> int:
    params = {"mode": mode, "clear_cache": "true" if clear_cache else "false"}
    async with s.post(base + "/pause", params=params) as r:
        await r.read()
        return r.status


async def is_paused(s: aiohttp.ClientSession, base: str) -> bool:
    return bool((await get_json(s, base + "/is_paused"))["is_paused"])


async def test_state_and_idempotency_across_cycles(resumed: Any, session: aiohttp.ClientSession) -> None:
    base = resumed.url
    assert await is_paused(session, base) is False
    assert [(await post(session, base + "/resume"))[0] for _ in range(2)] == [200, 200]
    assert await is_paused(session, base) is False
    for _ in range(2):
        for mode in ("abort", "wait", "keep"):
            assert [await pause(session, base, mode) for _ in range(2)] == [200, 200]
            assert await is_paused(session, base) is True
            assert (await lg_state(session, base))["state"] == "PAUSED"
            assert [(await post(session, base + "/resume"))[0] for _ in range(2)] == [200, 200]
            assert await is_paused(session, base) is False
            assert (await lg_state(session, base))["state"] == "RUNNING"


@pytest.mark.parametrize("paused", [False, True])
async def test_invalid_mode_preserves_state(resumed: Any, session: aiohttp.ClientSession, paused: bool) -> None:
    base = resumed.url
    if paused:
        assert await pause(session, base) == 200
    assert await is_paused(session, base) is paused
    status, body, _ = await post(session, base + "/pause?mode=invalid")
    assert status == 400
    # vLLM's test reads error.param == "query.mode"; the proxy validates first and names the param
    assert "mode" in str(body["error"]["param"]), body
    assert await is_paused(session, base) is paused
    assert (await post(session, base + "/resume"))[0] == 200


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("mode", "expected"), [("abort", "abort"), ("wait", "length"), ("keep", "length")])
async def test_mode_request_lifecycle(
    resumed: Any, vllm_server: Any, session: aiohttp.ClientSession, mode: str, expected: str
) -> None:
    base = resumed.url
    stream = StreamReader()
    # The whole stream, paused or not, inside the test's 480 s (the session's 150 s would end it before the 300 s
    # wait below for the rest of it, and name the wrong deadline).
    whole_stream = aiohttp.ClientTimeout(total=420, sock_connect=30)
    stream_task = asyncio.ensure_future(stream.run(session, base + "/v1/completions", long_stream_body(), whole_stream))
    new_task: asyncio.Future[Any] | None = None
    try:
        await under_way(session, vllm_server.url, stream)
        stream.noticed_at = time.monotonic()
        assert not stream_task.done(), stream.timing()

        t0 = time.monotonic()
        assert await pause(session, base, mode) == 200
        pause_s = time.monotonic() - t0
        assert await is_paused(session, base) is True
        if mode in ("abort", "wait"):
            # abort: ended at once; wait: the pause call returned only once the stream had finished
            await asyncio.wait_for(stream_task, 30)  # the end can reach us late (a busy API server)
        else:
            assert not stream_task.done(), f"the stream ended before the pause ({pause_s:.3f} s): {stream.timing()}"
            frozen_at = await _drained(stream)
            # a negative check needs a window: vLLM's test waits 5 s; 1.5 s is ~500 tokens on this CPU
            await asyncio.sleep(1.5)
            assert not stream_task.done(), f"the stream ended while paused ({pause_s:.3f} s): {stream.timing()}"
            assert len(stream.chunks) == frozen_at, "the stream kept producing while paused with mode=keep"

        # a new request while paused is held by the proxy (vLLM never sees it)
        new_task = asyncio.ensure_future(post(session, base + "/v1/completions", json=short_completion_body(4)))
        await wait_held(session, base, 1)
        if mode == "keep":  # vLLM holds only the frozen stream, not the new request
            assert (await get_json(session, vllm_server.url + "/load")) == {"server_load": 1}
        else:
            await engine_never_saw_it(session, vllm_server.url)
        assert not new_task.done()

        assert (await post(session, base + "/resume"))[0] == 200
        # keep/wait: the rest of LONG tokens. About 100 s on a quiet CI machine; a rehearsal with other jobs on
        # the two cores took over 120 s (the old deadline), so the deadline only catches a stream that stopped.
        await asyncio.wait_for(stream_task, 300)
        status, body, _ = await asyncio.wait_for(new_task, 30)
    finally:
        for t in (stream_task, new_task):
            if t is not None and not t.done():
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)

    assert stream.status == 200 and not stream.errors, stream.errors
    assert stream.finish_reason == expected, stream.timing()
    if expected == "length":
        assert stream.completion_tokens == LONG
    else:
        assert stream.completion_tokens is not None and stream.completion_tokens < LONG
    if mode == "wait":
        assert pause_s > 0.2  # it really waited for the stream (it had hundreds of tokens to go)
    assert status == 200 and body["choices"], body


async def _drained(stream: StreamReader, quiet_s: float = 0.5, timeout: float = 15.0) -> int:
    """The chunk count once no chunk came for `quiet_s`: vLLM's API server, short of CPU, delivers tokens made
    before the freeze in late bursts; those are not progress made while paused."""
    deadline = time.monotonic() + timeout
    count, since = len(stream.chunks), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling the reader's count, not standing in for an event
        if len(stream.chunks) != count:
            count, since = len(stream.chunks), time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return count
    raise AssertionError(f"the stream never went quiet while paused with mode=keep: {stream.timing()}")


PARIS = "Paris is the capital of France. Berlin is the capital of Germany. " * 5


async def test_clear_cache_preserves_output_and_controls_prefix_cache(
    resumed: Any, session: aiohttp.ClientSession
) -> None:
    base = resumed.url
    body = {"model": MODEL, "prompt": PARIS, "max_tokens": 8, "temperature": 0, "logprobs": 1}

    async def run() -> tuple[Any, int]:
        status, j, _ = await post(session, base + "/v1/completions", json=body)
        assert status == 200, j
        c = j["choices"][0]
        golden = (
            c["text"],
            c["finish_reason"],
            c["logprobs"]["tokens"],
            j["usage"]["prompt_tokens"],
            j["usage"]["completion_tokens"],
        )
        return golden, j["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await pause(session, base, clear_cache=True) == 200
    assert (await post(session, base + "/resume"))[0] == 200
    baseline, cached = await run()
    assert cached == 0
    _, cached = await run()
    assert cached > 0

    assert await pause(session, base, clear_cache=False) == 200
    assert (await post(session, base + "/resume"))[0] == 200
    golden, cached = await run()
    assert golden == baseline and cached > 0

    assert await pause(session, base, clear_cache=True) == 200
    assert (await post(session, base + "/resume"))[0] == 200
    golden, cached = await run()
    assert golden == baseline and cached == 0


async def test_pause_wait_when_idle_returns_at_once(
    resumed: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    """Nothing in flight, nothing to wait for: answered, not left waiting for requests that never come (the wrong
    outcome waits until the call's deadline, 30 minutes)."""
    assert (await get_json(session, vllm_server.url + "/load")) == {"server_load": 0}
    assert await asyncio.wait_for(pause(session, resumed.url, "wait"), 60) == 200
    await wait_until(lambda: lg_state(session, resumed.url), lambda s: s["state"] == "PAUSED", what="PAUSED")
