"""A LoRA adapter through the proxy on the real vLLM-for-CPU 0.32, across the sleeps an RL trainer runs: the adapter,
loaded through the proxy, answers as itself (its own text at temperature 0, not the base model's) after a level-1
sleep and wake, after a level-2 sleep, wake and weight reload, and after a level-2 sleep woken the SkyRL way (the
weights, their reload, then the KV cache).

The vLLM is the one scripts/test-vllm.sh starts for the conformance suite (`--enable-lora --max-lora-rank 8
--max-loras 1`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), passed as LIFEGUARD_VLLM_LORA_ENGINE_URL, with the adapter that
scripts/vllm/make_tiny_lora.py builds (LIFEGUARD_VLLM_LORA_PATH: lora_B not zero, so the adapter's answer differs from
the base model's). The suite's own vLLM runs without LoRA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.lifeguard_testing import missing
from tests.vllm.conftest import PROXIES, Proxy, free_port, http
from tests.vllm.vllm_e2e import lg_state, post

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

ADAPTER = "lg-adapter"
PROMPT = {"prompt": "hello world the model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
RELOAD = {"method": "reload_weights"}


@pytest.fixture(scope="module")
def lora_engine() -> tuple[str, str, str]:
    """(vLLM's URL, the adapter's folder, the base model's served name)."""
    url, path = os.environ.get("LIFEGUARD_VLLM_LORA_ENGINE_URL"), os.environ.get("LIFEGUARD_VLLM_LORA_PATH")
    if not url or not path:
        missing("LIFEGUARD_VLLM_LORA_ENGINE_URL/LIFEGUARD_VLLM_LORA_PATH unset: "
                "scripts/test-vllm.sh runs this file against its vLLM with --enable-lora")  # fmt: skip
    status, raw = http("GET", url + "/v1/models")
    assert status == 200, raw
    return url, path, "tiny"


@pytest.fixture
def lora_proxy(lora_engine: tuple[str, str, str], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Proxy]:
    """A proxy with default settings in front of the LoRA vLLM, awake and resumed first (the conformance suite ran
    on it before), no adapter of ours loaded."""
    url = lora_engine[0]
    for path in ("/wake_up", "/resume"):
        status, raw = http("POST", url + path, timeout=30)
        assert status == 200, (path, status, raw)
    http("POST", url + "/v1/unload_lora_adapter", {"lora_name": ADAPTER})  # a rerun after a failure: 404 otherwise
    proxy = Proxy(port=free_port(), upstream=url, log_path=tmp_path / "proxy-lora.log")
    request.node.stash[PROXIES] = [proxy]
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


async def _text(s: aiohttp.ClientSession, base: str, model: str) -> str:
    status, body, _ = await post(s, base + "/v1/completions", json={"model": model, **PROMPT})
    assert status == 200, body
    assert body["model"] == model, body
    return str(body["choices"][0]["text"])


async def _ok(s: aiohttp.ClientSession, base: str, path: str, **kw: object) -> dict[str, str]:
    status, body, headers = await post(s, base + path, **kw)
    assert status == 200, (path, status, body)
    return dict(headers)


async def _level_1(s: aiohttp.ClientSession, base: str) -> None:
    await _ok(s, base, "/sleep?level=1")
    woke = await _ok(s, base, "/wake_up")
    # The proxy's own LoRA check ran in the wake (proxy/lifecycle/verifier.py): listed, and its canary as before.
    assert "lora=pass" in woke["X-Lifeguard-Verified"], woke


async def _level_2(s: aiohttp.ClientSession, base: str) -> None:
    await _ok(s, base, "/sleep?level=2")
    await _ok(s, base, "/wake_up")
    await _ok(s, base, "/collective_rpc", json=RELOAD)


async def _level_2_weights_first(s: aiohttp.ClientSession, base: str) -> None:
    await _ok(s, base, "/sleep?level=2")
    await _ok(s, base, "/wake_up?tags=weights")
    await _ok(s, base, "/collective_rpc", json=RELOAD)
    await _ok(s, base, "/wake_up?tags=kv_cache")


CYCLES = {"level 1": _level_1, "level 2 and reload": _level_2, "level 2, weights first": _level_2_weights_first}


@pytest.mark.parametrize("cycle", list(CYCLES))
async def test_an_adapter_loaded_through_the_proxy_answers_as_itself_after_each_wake(
    lora_proxy: Proxy, lora_engine: tuple[str, str, str], session: aiohttp.ClientSession, cycle: str
) -> None:
    s, base = session, lora_proxy.url
    _, path, model = lora_engine
    await _ok(s, base, "/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": path})
    try:
        listed = [card["id"] for card in (await (await s.get(base + "/v1/models")).json())["data"]]
        assert ADAPTER in listed, listed
        base_answer, own = await _text(s, base, model), await _text(s, base, ADAPTER)
        assert own != base_answer, "the adapter answers as the base model before any sleep: it is not applied"

        await CYCLES[cycle](s, base)

        assert (await lg_state(s, base))["state"] == "RUNNING"
        after = await _text(s, base, ADAPTER)
        assert after != base_answer, f"after the {cycle} cycle the adapter answers as the base model: {after!r}"
        assert after == own, f"after the {cycle} cycle the adapter answers {after!r}, before it {own!r}"
        assert await _text(s, base, model) == base_answer
    finally:
        status, raw = http("POST", lora_proxy.url + "/v1/unload_lora_adapter", {"lora_name": ADAPTER}, timeout=30)
        assert status == 200, raw
