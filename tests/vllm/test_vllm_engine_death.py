"""Engine death: vLLM is SIGKILLed (its whole process group, by PID) while a stream and a lifecycle call
are in flight through the proxy; the proxy answers cleanly, goes FAILED, and recovers when vLLM is back
on the same port. This is the suite's one vLLM restart (~35 s)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.vllm.vllm_e2e import (
    StreamReader,
    assert_proxy_error,
    lg_state,
    long_stream_body,
    post,
    short_completion_body,
    under_way,
    wait_state,
    wait_until,
)

# The steps' deadlines add up to 390 s (under_way 30, PAUSING 30, the pause 60, the stream 30, FAILED 30, the
# restart 150, RUNNING 60), inside the test's 400 s: a hang is named by its own deadline.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


async def test_engine_killed_mid_stream_and_mid_lifecycle_call_then_recovers(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    base = proxy.url
    stream = StreamReader()
    stream_task = asyncio.ensure_future(stream.run(session, base + "/v1/completions", long_stream_body()))
    pause_task = None
    try:
        await under_way(session, vllm_server.url, stream)
        # /pause?mode=wait blocks upstream until the stream ends: a lifecycle call surely in flight
        pause_task = asyncio.ensure_future(post(session, base + "/pause?mode=wait"))
        # 30 s: a reconcile round holds the coordinator while vLLM's /health is late (up to control_call_timeout_s,
        # 10 s; a rehearsal saw it), and the pause starts after it
        await wait_until(lambda: lg_state(session, base), lambda s: s["state"] == "PAUSING", timeout=30, what="PAUSING")
        assert not stream_task.done(), "the stream ended before the kill: make it longer"
        vllm_server.kill()

        status, body, headers = await asyncio.wait_for(pause_task, 60)
        assert_proxy_error(status, body, headers, 503)
        await asyncio.wait_for(stream_task, 30)  # cut by the same kill the pause saw
    finally:
        for t in (stream_task, pause_task):
            if t is not None and not t.done():
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)

    # the stream was cut: it ends with an SSE error event, not a silent truncation and not "length"
    assert stream.status == 200
    assert stream.errors, f"no SSE error event at the end of a cut stream; last events {stream.events[-3:]}"
    assert stream.finish_reason is None
    assert isinstance(stream.errors[-1]["error"], dict) and stream.errors[-1]["error"].get("message")

    st = await wait_state(session, base, "FAILED", timeout=30)
    assert st["last_error"] is not None, st

    status, body, headers = await post(session, base + "/v1/completions", json=short_completion_body())
    assert_proxy_error(status, body, headers, 503)
    assert headers.get("X-Lifeguard-Reason") == "engine_unavailable"
    status, body, headers = await post(session, base + "/sleep?level=1")
    assert_proxy_error(status, body, headers, 503)

    await asyncio.to_thread(vllm_server.restart, 150)  # same port; healthy in ~35 s on CI
    await wait_state(session, base, "RUNNING", timeout=60)
    status, body, _ = await post(session, base + "/v1/completions", json=short_completion_body())
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
