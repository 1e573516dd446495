"""Requests vLLM has not finished when it sleeps at level 2, against a real vLLM 0.32 (issue 20).

After `sleep?level=2` vLLM holds no valid weights; a request it still holds runs on after the wake and answers
from discarded weights. The deterministic way to hold one in vLLM is `mode=keep`, which freezes running
requests in place (a request in transit, sent and not yet scheduled, cannot be held there on purpose: nothing
in vLLM pauses a request between its HTTP layer and its scheduler; the simulator's `slow` fault does, see
tests/e2e/test_in_transit.py). The proxy must end both kinds before any wake: the client gets 503
`aborted_by_sleep` (a stream that started: the error event, then its end), and vLLM, seeing its client gone,
aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.vllm.vllm_e2e import (
    LONG,
    MODEL,
    StreamReader,
    assert_proxy_error,
    engine_requests,
    get_json,
    lg_state,
    long_stream_body,
    metrics,
    post,
    under_way,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


async def _aborted_by_vllm(session: aiohttp.ClientSession, vllm: str) -> None:
    """vLLM let go of the request once its client (the proxy) closed the connection: its API server at once, its
    engine's gauges at their next stats update, which on two busy cores came after /load read 0 (a CI
    rehearsal of 2026-12-06 failed twice on an assertion made at once)."""
    await wait_until(lambda: get_json(session, vllm + "/load"), lambda load: load == {"server_load": 0},
                     timeout=30, what="vLLM dropping the aborted request")  # fmt: skip
    await wait_until(lambda: metrics(session, vllm), lambda samples: engine_requests(samples) == 0,
                     timeout=30, what="vLLM's engine dropping the aborted request")  # fmt: skip


async def test_a_stream_frozen_by_a_level_2_keep_sleep_ends_with_an_error_event_before_the_wake(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    stream = StreamReader()
    task = asyncio.ensure_future(stream.run(session, proxy.url + "/v1/completions", long_stream_body()))
    try:
        await under_way(session, vllm_server.url, stream)
        assert (await post(session, proxy.url + "/sleep?level=2&mode=keep"))[0] == 200
        await asyncio.wait_for(task, 30)  # ended by the proxy, not by the wake
        await _aborted_by_vllm(session, vllm_server.url)
        assert (await post(session, proxy.url + "/wake_up"))[0] == 200
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert stream.status == 200
    assert "[DONE]" not in stream.events, stream.timing()
    assert [e["error"]["reason"] for e in stream.errors] == ["aborted_by_sleep"], stream.timing()
    assert (stream.completion_tokens or 0) < LONG
    state = await lg_state(session, proxy.url)
    assert state["weights_stale_reason"] == "discarded" and state["inflight_requests"] == 0, state


async def test_a_running_completion_frozen_by_a_level_2_keep_sleep_is_answered_503(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "Count upward slowly:", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    task = asyncio.ensure_future(post(session, proxy.url + "/v1/completions", json=body))
    started = time.monotonic()
    await wait_until(lambda: get_json(session, vllm_server.url + "/load"), lambda load: load["server_load"] == 1,
                     timeout=30, what="vLLM running the completion")  # fmt: skip
    assert (await post(session, proxy.url + "/sleep?level=2&mode=keep"))[0] == 200
    status, error_body, headers = await asyncio.wait_for(task, 30)
    err = assert_proxy_error(status, error_body, headers, 503)
    assert err["reason"] == "aborted_by_sleep", (err, time.monotonic() - started)
    await _aborted_by_vllm(session, vllm_server.url)
    assert (await post(session, proxy.url + "/wake_up"))[0] == 200
