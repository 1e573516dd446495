"""Operating policies against a real vLLM 0.32 (CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.vllm.vllm_e2e import MODEL, lg_state, metrics, post, sleep_ops, vllm_flags

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


async def test_wake_on_request_answers_a_request_sent_to_a_sleeping_engine(
    start_proxy: Callable[..., Any], vllm_server: Any, session: aiohttp.ClientSession, oai_direct: AsyncOpenAI
) -> None:
    proxy = start_proxy(LIFEGUARD_ON_SLEEPING="wake")
    oai = AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        expected = await oai_direct.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
        warm_started = time.monotonic()
        await oai.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
        awake_s = time.monotonic() - warm_started
        status, _, _ = await post(session, proxy.url + "/sleep?level=1")
        assert status == 200
        assert (await vllm_flags(session, vllm_server.url))[0] is True
        wakes_before = sleep_ops(await metrics(session, vllm_server.url), "wake")
        started = time.monotonic()
        answer = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
        asleep_s = time.monotonic() - started
        assert answer.choices[0].text == expected.choices[0].text
        assert (await lg_state(session, proxy.url))["state"] == "RUNNING"
        assert (await vllm_flags(session, vllm_server.url))[0] is False
        assert sleep_ops(await metrics(session, vllm_server.url), "wake") == wakes_before + 1
        # The figure for the closing note: what waking on demand added to the first request.
        print(f"\nwake-on-request: first request {asleep_s * 1000:.0f} ms asleep vs {awake_s * 1000:.0f} ms awake")
    finally:
        await oai.close()
