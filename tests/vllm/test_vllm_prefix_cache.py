"""The prefix cache after a weight change, on the real vLLM-for-CPU (docs/verification.md, the prefix cache).

The fully-async order: a long prefix cached, a long stream running, `/pause?mode=keep&clear_cache=false`, the model's
file changed on disk and `collective_rpc reload_weights`, `/reset_prefix_cache` (200 `{"success": false}`: the kept
stream holds blocks), `/resume`. Direct, the cached prompt is then answered from KV the old weights computed; through
the lifeguard, as the new weights answer it with an empty cache. Answers are compared sent alone (the tiny model's
greedy answer can change with the batch it runs in); a control run that changes no weights must give equal answers.
If the direct test stops reproducing the stale answer, vLLM has fixed it, and this file says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm.conftest import reset_vllm
from tests.vllm.vllm_e2e import MODEL, StreamReader, get_json, lg_state, long_stream_body, post, under_way, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

# Several of vLLM's KV blocks long, so whole blocks of it are cached by its first answer.
PROMPT = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 40 + "So the fox"
_PERTURB = """
import sys, torch
from safetensors.torch import load_file, save_file
tensors = load_file(sys.argv[1])
generator = torch.Generator().manual_seed(36)
# Each tensor's own values, shuffled: weights of the same scale as a trained step's, and a different model.
save_file({name: t.flatten()[torch.randperm(t.numel(), generator=generator)].view_as(t).contiguous()
           for name, t in tensors.items()}, sys.argv[1], metadata={"format": "pt"})
"""


@pytest.fixture
def weights_file() -> Path:
    """The served model's weights file (restored and reloaded by `_from_an_empty_cache`)."""
    return Path(os.environ["LIFEGUARD_VLLM_MODEL"]) / "model.safetensors"


def _change_weights(path: Path) -> None:
    """New weights on disk, as a trainer's checkpoint would write them (vLLM's own venv has torch)."""
    python = os.environ["LIFEGUARD_VLLM_PYTHON"]
    subprocess.run([python, "-c", _PERTURB, str(path)], check=True, timeout=120, capture_output=True)


async def _answer(s: aiohttp.ClientSession, base: str) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    status, payload, _ = await post(s, base + "/v1/completions", json=body)
    assert status == 200, payload
    return str(payload["choices"][0]["text"])


async def _idle(s: aiohttp.ClientSession, vllm: str) -> None:
    await wait_until(lambda: get_json(s, vllm + "/load"), lambda load: load["server_load"] == 0, 30, "vLLM idle")


async def _reset_succeeds(s: aiohttp.ClientSession, vllm: str) -> None:
    """Empty vLLM's prefix cache, directly. A request ended a moment ago (the last test's, a stream cancelled) can hold
    its blocks until the engine's next step frees them, and the reset says `success: false` meanwhile: asked again,
    as vLLM's docstring says callers may, until it succeeds (30 s)."""

    async def reset() -> tuple[int, Any]:
        status, body, _ = await post(s, vllm + "/reset_prefix_cache")
        return status, body

    await wait_until(reset, lambda answer: answer == (200, {"success": True}), 30, "a prefix-cache reset to succeed")


@contextlib.asynccontextmanager
async def _kept_stream(s: aiohttp.ClientSession, base: str, vllm: str) -> AsyncIterator[None]:
    """A long stream under way for the block, ended (its client gone) on the way out; vLLM idle after."""
    stream = StreamReader()
    task = asyncio.ensure_future(stream.run(s, base + "/v1/completions", long_stream_body()))
    try:
        await under_way(s, vllm, stream)
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _idle(s, vllm)


async def _fully_async_sync(
    s: aiohttp.ClientSession, base: str, vllm: str, weights: Path | None
) -> tuple[int, Any, Any]:
    """pause keep, (new weights on disk and) reload_weights, the reset's answer, resume; the reset's answer."""
    assert (await post(s, base + "/pause?mode=keep&clear_cache=false"))[0] == 200
    if weights is not None:
        _change_weights(weights)
    status, body, _ = await post(s, base + "/collective_rpc", json={"method": "reload_weights"})
    assert status == 200, body
    reset = await post(s, base + "/reset_prefix_cache")
    status, body, _ = await post(s, base + "/resume")
    assert status == 200, body
    return reset


@contextlib.asynccontextmanager
async def _from_an_empty_cache(s: aiohttp.ClientSession, vllm: str, weights: Path) -> AsyncIterator[None]:
    """The block starts with an empty prefix cache; afterwards vLLM serves the original weights again."""
    original = weights.read_bytes()
    await _reset_succeeds(s, vllm)
    try:
        yield
    finally:
        weights.write_bytes(original)
        status, body, _ = await post(s, vllm + "/collective_rpc", json={"method": "reload_weights"})
        assert status == 200, body
        await _reset_succeeds(s, vllm)


async def _then_fresh(s: aiohttp.ClientSession, base: str, vllm: str) -> tuple[str, str]:
    """The cached prompt's answer through `base`, and vLLM's own once a reset has emptied the cache."""
    served = await _answer(s, base)
    await _reset_succeeds(s, vllm)
    return served, await _answer(s, vllm)


@pytest.mark.parametrize("change", [True, False], ids=["new-weights", "control"])
async def test_direct_vllm_serves_the_old_weights_prefix_after_a_kept_pause(
    change: bool, vllm_server: Any, weights_file: Path, session: aiohttp.ClientSession
) -> None:
    reset_vllm(vllm_server)
    vllm = vllm_server.url
    async with _from_an_empty_cache(session, vllm, weights_file):
        await _answer(session, vllm)  # the prefix, cached under the old weights
        async with _kept_stream(session, vllm, vllm):
            status, body, _ = await _fully_async_sync(session, vllm, vllm, weights_file if change else None)
            assert (status, body) == (200, {"success": False})  # the kept stream holds blocks
        # each sent alone: from the blocks cached before the change, then with the cache truly empty
        served, fresh = await _then_fresh(session, vllm, vllm)
    if change:
        assert served != fresh, "vLLM no longer serves the old weights' prefix after a failed reset: fixed upstream?"
    else:
        assert served == fresh  # the control: no weight change, the cache changes nothing


async def test_through_the_lifeguard_the_answer_is_the_new_weights_own(
    vllm_server: Any, start_proxy: Any, weights_file: Path, session: aiohttp.ClientSession
) -> None:
    # The reconcile loop's own reset would clear the partition once the stream ends: here the salt must do it.
    proxy = start_proxy(LIFEGUARD_RECONCILE_INTERVAL_S="300")
    vllm, base = vllm_server.url, proxy.url
    async with _from_an_empty_cache(session, vllm, weights_file):
        await _answer(session, base)
        async with _kept_stream(session, base, vllm):
            status, body, headers = await _fully_async_sync(session, base, vllm, weights_file)
            assert (status, body) == (200, {"success": False})  # vLLM's answer, as vLLM gave it
            assert headers["X-Lifeguard-Prefix-Cache"] == "partitioned"
        state = await lg_state(session, base)
        assert state["prefix_cache"]["partitioned"], state
        through, fresh = await _then_fresh(session, base, vllm)
    assert through == fresh


async def test_a_forgotten_reset_is_made_by_the_lifeguard(
    vllm_server: Any, proxy: Any, weights_file: Path, session: aiohttp.ClientSession
) -> None:
    """No pause, no reset: a reload while idle, then the cached prompt. The lifeguard resets the cache itself."""
    vllm, base = vllm_server.url, proxy.url
    async with _from_an_empty_cache(session, vllm, weights_file):
        await _answer(session, base)
        _change_weights(weights_file)
        status, body, _ = await post(session, base + "/collective_rpc", json={"method": "reload_weights"})
        assert status == 200, body
        assert not (await lg_state(session, base))["prefix_cache"]["partitioned"]  # its reset succeeded
        through, fresh = await _then_fresh(session, base, vllm)
    assert through == fresh
