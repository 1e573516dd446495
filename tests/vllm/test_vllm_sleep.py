"""Sleep and wake through the proxy, against a real vLLM 0.32 (CPU: the flags and scheduler are real,
no memory is freed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.vllm.vllm_e2e import (
    MODEL,
    assert_proxy_error,
    engine_never_saw_it,
    lg_state,
    metrics,
    post,
    sleep_ops,
    sleep_state,
    vllm_flags,
    wait_held,
    wait_state,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


@pytest.fixture
async def bg() -> AsyncIterator[Callable[[Any], asyncio.Future[Any]]]:
    """Run coroutines in the background; whatever is still pending at the end is cancelled."""
    tasks: list[asyncio.Future[Any]] = []

    def spawn(coro: Any) -> asyncio.Future[Any]:
        t = asyncio.ensure_future(coro)
        tasks.append(t)
        return t

    try:
        yield spawn
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def completion(oai: AsyncOpenAI, max_tokens: int = 8) -> Any:
    return oai.completions.create(model=MODEL, prompt="hello world", max_tokens=max_tokens, temperature=0)


async def test_request_sent_during_sleep_is_held_by_proxy_and_completes_after_wake(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, oai: AsyncOpenAI, oai_direct: AsyncOpenAI, bg: Any
) -> None:
    expected = (await completion(oai_direct)).choices[0].text
    status, body, _ = await post(session, proxy.url + "/sleep?level=1")
    assert (status, body) == (200, {"status": "sleeping", "level": 1})
    st = await lg_state(session, proxy.url)
    assert st["state"] == "SLEEPING" and st["sleep_level"] == 1
    assert (await vllm_flags(session, vllm_server.url))[0] is True

    held = bg(completion(oai))
    await wait_held(session, proxy.url, 1)
    await engine_never_saw_it(session, vllm_server.url)  # held by the proxy, not queued in vLLM
    assert not held.done()

    status, body, _ = await post(session, proxy.url + "/wake_up")
    assert status == 200
    result = await asyncio.wait_for(held, 30)
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "length"
    st = await lg_state(session, proxy.url)
    assert (st["state"], st["held_requests"], st["asleep_tags"]) == ("RUNNING", 0, [])
    assert (await vllm_flags(session, vllm_server.url))[:2] == (False, False)


async def test_partial_wake_weights_keeps_holding_and_kv_cache_releases(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, oai: AsyncOpenAI, bg: Any
) -> None:
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    held = bg(completion(oai))
    await wait_held(session, proxy.url, 1)

    status, body, _ = await post(session, proxy.url + "/wake_up?tags=weights")
    assert status == 200, body
    st = await lg_state(session, proxy.url)
    assert st["state"] == "SLEEPING", st
    assert st["asleep_tags"] == ["kv_cache"], st
    assert st["held_requests"] == 1 and not held.done()
    assert (await vllm_flags(session, vllm_server.url))[0] is True  # vLLM: still sleeping after weights
    await engine_never_saw_it(session, vllm_server.url)

    status, body, _ = await post(session, proxy.url + "/wake_up?tags=kv_cache")
    assert status == 200, body
    result = await asyncio.wait_for(held, 30)
    assert result.choices[0].finish_reason == "length"
    st = await wait_state(session, proxy.url, "RUNNING")
    assert st["asleep_tags"] == [] and st["held_requests"] == 0


async def test_repeated_sleep_is_answered_by_proxy_not_forwarded_and_held_requests_survive(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, oai: AsyncOpenAI, bg: Any
) -> None:
    """vLLM alone would run the repeat: count it in its histogram and abort the requests queued meanwhile."""
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    held = bg(completion(oai))
    await wait_held(session, proxy.url, 1)
    sleeps = sleep_ops(await metrics(session, vllm_server.url))

    status, body, headers = await post(session, proxy.url + "/sleep?level=1")
    assert (status, body) == (200, {"status": "sleeping", "level": 1})
    assert headers.get("X-Lifeguard-Noop") == "true"
    assert sleep_ops(await metrics(session, vllm_server.url)) == sleeps  # not forwarded
    assert not held.done()

    assert (await post(session, proxy.url + "/wake_up"))[0] == 200
    result = await asyncio.wait_for(held, 30)
    assert result.choices[0].finish_reason == "length"  # not "abort", as vLLM's own repeat would give


async def test_sleep_at_another_level_while_asleep_is_409_not_forwarded(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    sleeps = await metrics(session, vllm_server.url)
    status, body, headers = await post(session, proxy.url + "/sleep?level=2")
    assert_proxy_error(status, body, headers, 409)
    after = await metrics(session, vllm_server.url)
    assert sleep_ops(after) == sleep_ops(sleeps)
    assert sleep_state(after) == (0.0, 1.0, 0.0)  # vLLM would have rewritten it to level 2


async def test_wake_when_awake_is_a_noop_not_forwarded(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    wakes = sleep_ops(await metrics(session, vllm_server.url), "wake")
    status, _, headers = await post(session, proxy.url + "/wake_up")
    assert status == 200
    assert headers.get("X-Lifeguard-Noop") == "true"
    assert sleep_ops(await metrics(session, vllm_server.url), "wake") == wakes


async def test_resume_while_asleep_is_409_and_engine_stays_asleep(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    """vLLM alone answers 200 and schedules requests on (on GPU: unmapped) memory while asleep."""
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    status, body, headers = await post(session, proxy.url + "/resume")
    assert_proxy_error(status, body, headers, 409)
    assert (await vllm_flags(session, vllm_server.url))[:2] == (True, True)
    assert (await lg_state(session, proxy.url))["state"] == "SLEEPING"


async def test_wake_while_user_paused_keeps_the_pause(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, oai: AsyncOpenAI, bg: Any
) -> None:
    """vLLM alone lifts a /pause on /wake_up (measured: is_paused true -> false)."""
    assert (await post(session, proxy.url + "/pause"))[0] == 200
    assert (await lg_state(session, proxy.url))["state"] == "PAUSED"
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    assert (await post(session, proxy.url + "/wake_up"))[0] == 200

    st = await lg_state(session, proxy.url)
    assert st["state"] == "PAUSED" and st["paused"] is True, st
    is_sleeping, is_paused, _ = await vllm_flags(session, vllm_server.url)
    assert (is_sleeping, is_paused) == (True, True)  # vLLM reports a plain pause as "sleeping" too

    held = bg(completion(oai))
    await wait_held(session, proxy.url, 1)
    await engine_never_saw_it(session, vllm_server.url)

    assert (await post(session, proxy.url + "/resume"))[0] == 200
    result = await asyncio.wait_for(held, 30)
    assert result.choices[0].finish_reason == "length"
    assert (await vllm_flags(session, vllm_server.url))[:2] == (False, False)
    assert (await lg_state(session, proxy.url))["state"] == "RUNNING"


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/sleep?level=5", "level"),
        ("/sleep?level=-1", "level"),
        ("/sleep?level=x", "level"),
        ("/sleep?mode=bogus", "mode"),
        ("/pause?mode=bogus", "mode"),
        ("/wake_up?tags=bogus", "tags"),  # vLLM alone: 200 {"status":"awake","tags":["bogus"]}
    ],
)
async def test_bad_lifecycle_params_are_400_naming_the_param_and_not_forwarded(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, path: str, param: str
) -> None:
    before = await metrics(session, vllm_server.url)
    status, body, headers = await post(session, proxy.url + path)
    err = assert_proxy_error(status, body, headers, 400)
    assert param in str(err["param"]), err
    after = await metrics(session, vllm_server.url)
    assert (sleep_ops(after), sleep_ops(after, "wake")) == (sleep_ops(before), sleep_ops(before, "wake"))
    assert (await vllm_flags(session, vllm_server.url))[:2] == (False, False)
    assert (await lg_state(session, proxy.url))["state"] == "RUNNING"


async def test_comma_joined_wake_tags_reach_vllm_as_repeated_params(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    """vLLM alone treats tags=weights,kv_cache as one unknown tag: 200 and still asleep."""
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    status, body, _ = await post(session, proxy.url + "/wake_up?tags=weights,kv_cache")
    assert status == 200, body
    assert (await vllm_flags(session, vllm_server.url))[:2] == (False, False)
    assert (await wait_state(session, proxy.url, "RUNNING"))["asleep_tags"] == []


async def test_vllm_test_sleep_mode_replayed_through_proxy(proxy: Any, session: aiohttp.ClientSession) -> None:
    """tests/entrypoints/serve/dev/test_sleep.py::test_sleep_mode, every step through the proxy."""
    base = proxy.url

    async def is_sleeping() -> bool:
        async with session.get(base + "/is_sleeping") as r:
            assert r.status == 200
            return bool((await r.json())["is_sleeping"])

    async def sleep_metric() -> tuple[float, float, float]:
        return sleep_state(await metrics(session, base))

    assert (await post(session, base + "/sleep?level=1"))[0] == 200
    assert await is_sleeping() is True
    assert await sleep_metric() == (0.0, 1.0, 0.0)
    assert (await post(session, base + "/wake_up"))[0] == 200
    assert await is_sleeping() is False
    assert await sleep_metric() == (1.0, 0.0, 0.0)

    assert (await post(session, base + "/sleep?level=1"))[0] == 200
    assert (await post(session, base + "/wake_up?tags=weights"))[0] == 200
    assert await is_sleeping() is True
    assert (await post(session, base + "/wake_up?tags=kv_cache"))[0] == 200
    assert await is_sleeping() is False
    assert await sleep_metric() == (1.0, 0.0, 0.0)


async def test_level2_sleep_keeps_holding_until_weights_are_reloaded(
    start_proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, bg: Any
) -> None:
    """After level 2, a full wake leaves garbage weights on GPU; the proxy holds until reload_weights."""
    proxy = start_proxy(LIFEGUARD_HOLD_WHILE_WEIGHTS_STALE="true")
    async with AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        assert (await post(session, proxy.url + "/sleep?level=2"))[0] == 200
        held = bg(completion(oai))
        await wait_held(session, proxy.url, 1)
        assert (await post(session, proxy.url + "/wake_up"))[0] == 200
        st = await lg_state(session, proxy.url)
        assert st["weights_stale"] is True and st["held_requests"] == 1, st
        assert (await vllm_flags(session, vllm_server.url))[0] is False  # vLLM itself is awake
        await engine_never_saw_it(session, vllm_server.url)
        assert not held.done()

        status, body, _ = await post(session, proxy.url + "/collective_rpc", json={"method": "reload_weights"})
        assert (status, body) == (200, {"results": [None]})
        result = await asyncio.wait_for(held, 30)
        assert result.choices[0].finish_reason == "length"
        st = await wait_state(session, proxy.url, "RUNNING")
        assert st["weights_stale"] is False
