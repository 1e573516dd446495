"""A stall behind a healthy `/health` (field reports: hours at 0 tokens/s with requests running): requests in flight
and no byte from vLLM for `stall_after_s` while RUNNING make the engine not ready, set lifeguard_engine_stalled and log
a WARNING naming it; the first bytes again clear it (docs/verification.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack


async def _stalled_gauge(stack: Stack) -> str:
    text = await (await stack.client.get("/lifeguard/metrics")).text()
    (line,) = [row for row in text.splitlines() if row.startswith("lifeguard_engine_stalled{")]
    return line.rsplit(" ", 1)[1]


async def _serving_until(stack: Stack, status: int) -> Any:
    """`/lifeguard/serving` read until it answers `status`, for at most a few reconcile rounds."""
    deadline = time.monotonic() + 5 * stack.settings.reconcile_interval_s + 2
    while True:
        resp = await stack.client.get("/lifeguard/serving")
        if resp.status == status or time.monotonic() > deadline:
            return resp
        await asyncio.sleep(0.02)


async def test_requests_in_flight_with_no_byte_from_vllm_make_the_engine_not_ready_until_bytes_flow(
    make_stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    stack: Stack = await make_stack(stall_after_s=0.5)
    stack.faults("generate:stall:2")
    caplog.set_level(logging.WARNING, logger="lifeguard.lifecycle")
    streaming = stack.completion_in_background(max_tokens=8, stream=True)
    await stack.wait_for(lambda s: s["inflight_requests"] == 1)
    assert (await stack.client.get("/health")).status == 200  # vLLM's own health says nothing

    serving = await _serving_until(stack, 503)
    assert serving.status == 503 and (await serving.json())["error"]["cause"] == "stalled"
    assert await _stalled_gauge(stack) == "1.0"
    assert any("engine default stalled" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    finished = await asyncio.wait_for(streaming, 10)
    assert finished.status == 200
    assert (await _serving_until(stack, 200)).status == 200
    assert await _stalled_gauge(stack) == "0.0"


async def test_a_stall_is_seen_while_the_proxys_own_canary_waits_in_it(make_stack: Any, tmp_path: Path) -> None:
    """The reconcile round's LoRA canary (after an adapter load) met the stall first and waited in it: the watch, run
    in that round, waited too, and a router kept sending to the stalled engine (the check matrix's stall row)."""
    stack: Stack = await make_stack(SimSettings(**{**FAST_SIM.__dict__, "enable_lora": True}), stall_after_s=0.3)
    stack.faults("generate:stall:3")
    (tmp_path / "adapter_config.json").write_text("{}")
    loaded = await stack.client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path)})
    assert loaded.status == 200, await loaded.text()
    deadline = time.monotonic() + 5
    while not stack.sim.stalled:  # the next round's canary of the new adapter is the stall's first request
        assert time.monotonic() < deadline, "the adapter's canary never ran"
        await asyncio.sleep(0.01)
    request = stack.completion_in_background()
    serving = await _serving_until(stack, 503)
    assert not request.done(), "the stall ended before the check"
    assert serving.status == 503 and (await serving.json())["error"]["cause"] == "stalled"
    assert (await asyncio.wait_for(request, 10)).status == 200
