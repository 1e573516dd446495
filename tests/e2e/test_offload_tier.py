"""vLLM 0.34's KV-connector offload tier in the prefix-cache guarantee (docs/verification.md): the tier's block hashes
do not cover the weights (vLLM PR #57810), so a tier kept through a sleep (`reset_connector=false`) would serve KV the
old weights computed after a weight change. The proxy's reset empties both tiers (`reset_external=true`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack

TIERED = SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.34", "kv_connector": True})
# 5 whole blocks of 16 tokens: reused from whichever tier holds them
PROMPT = " ".join(["river light stone paper garden window engine signal"] * 10)


async def _answer(stack: Stack) -> str:
    resp = await stack.completion(PROMPT, max_tokens=6, ignore_eos=True)
    assert resp.status == 200, await resp.text()
    return str((await resp.json())["choices"][0]["text"])


async def _update_weights(stack: Stack) -> None:
    for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
        body = {"update_info": {}} if path == "/update_weights" else {}
        resp = await stack.client.post(path, json=body)
        assert resp.status == 200, (path, await resp.text())


def _stale_hits(stack: Stack) -> list[str]:
    return [v["kind"] for v in stack.sim.violations if str(v["kind"]).endswith("_stale_hit")]


async def test_a_tier_kept_through_a_sleep_is_emptied_by_the_proxys_reset_after_the_weight_change(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(TIERED)
    old = await _answer(stack)
    assert (await stack.client.post("/sleep?level=1&reset_connector=false")).status == 200
    assert (await stack.state())["offload_tier_kept"] is True
    assert stack.sim.state_dict()["offload_tier_blocks"] > 0
    assert (await stack.client.post("/wake_up")).status == 200
    await _update_weights(stack)
    snapshot = await stack.wait_for(lambda s: not s["prefix_cache"]["partitioned"], timeout=10)
    assert snapshot["offload_tier_kept"] is False
    assert stack.sim.state_dict()["offload_tier_blocks"] == 0
    assert await _answer(stack) != old
    assert _stale_hits(stack) == []


async def test_a_clients_reset_that_keeps_the_tier_does_not_end_the_partition(make_stack: Any) -> None:
    """The proxy's reset after a weight change is lost (500): both tiers keep the old weights' blocks and inference is
    salted. A client's reset told `reset_external=false` then empties the GPU cache only: the partition must last
    until a reset empties the tier too."""
    # The reconcile loop's own retry (with reset_external=true) would race the client's: it waits for a later round.
    stack: Stack = await make_stack(TIERED, reconcile_interval_s=30.0)
    old = await _answer(stack)
    stack.faults("reset_prefix_cache:error500")
    await _update_weights(stack)
    assert (await stack.state())["prefix_cache"]["partitioned"]
    assert stack.sim.state_dict()["offload_tier_blocks"] > 0
    reset = await stack.client.post("/reset_prefix_cache?reset_external=false")
    assert reset.status == 200 and await reset.json() == {"success": True}  # vLLM's own answer, as it was
    assert reset.headers["X-Lifeguard-Prefix-Cache"] == "partitioned"
    assert stack.sim.state_dict()["offload_tier_blocks"] > 0  # the client's choice kept: the tier not emptied
    assert (await stack.state())["prefix_cache"]["partitioned"]
    assert await _answer(stack) != old
    assert _stale_hits(stack) == []


async def test_a_restarted_proxy_still_knows_the_tier_was_kept(
    make_stack: Any, serve_lifeguard: Any, tmp_path: Path
) -> None:
    """vLLM shows no kept tier: only the state file tells a restarted proxy, whose state keeps saying so until its reset
    after the weight change empties both tiers."""
    stack: Stack = await make_stack(TIERED, state_file=str(tmp_path / "state.json"))
    old = await _answer(stack)
    assert (await stack.client.post("/sleep?level=1&reset_connector=false")).status == 200
    await stack.client.close()
    client = await serve_lifeguard(stack.settings)
    deadline = time.monotonic() + 5
    while (state := await (await client.get("/lifeguard/state")).json())["state"] != "SLEEPING":
        assert time.monotonic() < deadline, f"the new proxy never adopted the sleeping engine: {state}"
        await asyncio.sleep(0.01)
    assert state["offload_tier_kept"] is True
    assert stack.sim.state_dict()["offload_tier_blocks"] > 0
    assert (await client.post("/wake_up")).status == 200
    for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
        resp = await client.post(path, json={"update_info": {}} if path == "/update_weights" else {})
        assert resp.status == 200, (path, await resp.text())
    while (state := await (await client.get("/lifeguard/state")).json())["prefix_cache"]["partitioned"]:
        assert time.monotonic() < deadline + 5, f"the partition never ended: {state}"
        await asyncio.sleep(0.01)
    assert state["offload_tier_kept"] is False
    assert stack.sim.state_dict()["offload_tier_blocks"] == 0
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] != old
    assert _stale_hits(stack) == []
