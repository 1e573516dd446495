"""Requests the proxy sent before a sleep and that vLLM had not run yet (in transit, queued, or frozen by
`mode=keep`): after a level-2 sleep they would run on discarded weights, so the proxy ends them before any
wake is sent (issue 20); after a level-1 sleep or a pause they run correctly after the wake, as before.

The `slow` fault holds a request between vLLM's HTTP layer and its scheduler: the exact window of a request
the gate let through a moment before the sleep began.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings
from lifeguard_sim.keys import LIVE_REQUESTS
from tests.e2e.conftest import Stack

SLOW_TOKENS = SimSettings(token_seconds=0.05, sleep_seconds=0.01, wake_seconds=0.01)


async def _until(what: str, check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.01)


async def _sent_in_transit(stack: Stack, **body: Any) -> asyncio.Task[Any]:
    """A completion held by the engine's `slow` fault after it reached vLLM's HTTP layer."""
    stack.faults("generate:slow:2@1")
    request = asyncio.ensure_future(stack.completion(**body))
    await _until("the completion reached the engine", lambda: stack.sim_count("generate") >= 1)
    return request


async def _sim_idle(stack: Stack) -> None:
    """Every request the simulator was answering has ended (so whatever it would have run, it ran)."""
    live = stack.sim_server.app[LIVE_REQUESTS]
    await _until("the simulator answered everything", lambda: len(live) == 0, timeout=10)


def _kinds(stack: Stack) -> list[str]:
    return [str(v["kind"]) for v in stack.sim.violations]


async def test_a_request_in_transit_across_a_level_2_sleep_is_ended_503_not_run_on_discarded_weights(
    make_stack: Any,
) -> None:
    stack = await make_stack()
    request = await _sent_in_transit(stack)
    assert (await stack.client.post("/sleep", params={"level": "2"})).status == 200
    assert (await stack.client.post("/wake_up")).status == 200
    resp = await request
    body = await resp.json()
    assert resp.status == 503, body
    assert resp.headers["X-Lifeguard-Reason"] == "aborted_by_sleep"
    assert int(resp.headers["Retry-After"]) >= 1
    assert body["error"]["code"] == 503 and body["error"]["type"] == "ServiceUnavailableError"
    await _sim_idle(stack)
    assert "generate_with_invalid_weights" not in _kinds(stack), stack.sim.violations
    state = await stack.state()
    assert state["weights_stale_reason"] == "discarded" and state["inflight_requests"] == 0


async def test_a_stream_frozen_by_a_keep_sleep_at_level_2_ends_with_an_error_event_not_garbage(
    make_stack: Any,
) -> None:
    stack = await make_stack(SLOW_TOKENS)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "stream": True, "temperature": 0}
    async with stack.client.post("/v1/completions", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        sleep = await stack.client.post("/sleep", params={"level": "2", "mode": "keep"})
        assert sleep.status == 200
        assert (await stack.client.post("/wake_up")).status == 200
        rest = b""
        async with asyncio.timeout(15):
            while chunk := await resp.content.readany():
                rest += chunk
    events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events, rest
    assert b"[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["reason"] == "aborted_by_sleep" and error["code"] == 503
    await _sim_idle(stack)
    assert "generate_with_invalid_weights" not in _kinds(stack), stack.sim.violations


@pytest.mark.parametrize("how", ["sleep_level_1", "pause"])
async def test_a_request_in_transit_across_a_level_1_sleep_or_a_pause_still_runs_after_it(
    make_stack: Any, how: str
) -> None:
    stack = await make_stack()
    request = await _sent_in_transit(stack)
    if how == "pause":
        assert (await stack.client.post("/pause")).status == 200
        assert (await stack.client.post("/resume")).status == 200
    else:
        assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
        assert (await stack.client.post("/wake_up")).status == 200
    resp = await request
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["text"]
    await _sim_idle(stack)
    # It arrived while the engine was paused (in transit: vLLM queued it), and ran once it was awake.
    assert set(_kinds(stack)) <= {"generate_while_asleep_or_paused"}, stack.sim.violations
