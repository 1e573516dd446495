"""A KV connector's offload tier (`--kv-connector`) keyed by hashes that do not cover the weights (vLLM PR #57810):
after a weight change, a kept tier serves KV the old weights computed, as the GPU prefix cache would without a reset.
And the host memory a level-1 sleep's CPU backup takes, kept after the wake in 0.34."""

from __future__ import annotations

import pytest

from lifeguard_sim.memory import GIB
from tests.sim.conftest import Sim, SimFactory

# 5 whole blocks of 16 tokens: reused from whichever tier holds them
PROMPT = " ".join(["river light stone paper garden window engine signal"] * 10)


async def _answer(sim: Sim) -> str:
    answer = await sim.api.completion(PROMPT, max_tokens=6, ignore_eos=True)
    assert answer.status == 200
    return str(answer.body["choices"][0]["text"])


async def _update_weights(sim: Sim) -> None:
    for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
        body = {"update_info": {}} if path == "/update_weights" else None
        assert (await sim.api.call("POST", path, json_body=body)).status == 200


def _stale(sim: Sim) -> list[str]:
    return [v["kind"] for v in sim.engine.violations if v["kind"].endswith("_stale_hit")]


async def test_a_kept_tier_serves_kv_of_the_old_weights_after_the_gpu_cache_was_reset(make_sim: SimFactory) -> None:
    sim = await make_sim(kv_connector=True)
    old = await _answer(sim)
    await _update_weights(sim)
    assert (await sim.api.post("/reset_prefix_cache")).body == {"success": True}  # the GPU cache only
    assert await _answer(sim) == old  # computed by the old weights, loaded back from the tier
    assert _stale(sim) == ["offload_tier_stale_hit"]


async def test_reset_external_empties_the_tier_too(make_sim: SimFactory) -> None:
    sim = await make_sim(kv_connector=True)
    old = await _answer(sim)
    await _update_weights(sim)
    assert (await sim.api.post("/reset_prefix_cache", reset_external="true")).body == {"success": True}
    assert (await sim.state())["offload_tier_blocks"] == 0
    assert await _answer(sim) != old
    assert _stale(sim) == []


@pytest.mark.parametrize(
    ("version", "reset_connector", "kept"),
    [("0.34", "false", True), ("0.34", "true", False), ("0.33", "false", False)],
)
async def test_a_sleep_keeps_the_tier_only_when_034_is_told_not_to_reset_it(
    make_sim: SimFactory, version: str, reset_connector: str, kept: bool
) -> None:
    """0.33 has no reset_connector: every cache-clearing sleep resets the connector (EngineCore._reset_caches)."""
    sim = await make_sim(vllm_version=version, kv_connector=True)
    old = await _answer(sim)
    answer = await sim.api.call("POST", "/sleep", params={"level": "1", "reset_connector": reset_connector})
    assert answer.status == 200
    await sim.api.wake()
    await _update_weights(sim)
    state = await sim.state()
    assert state["prefix_cache_blocks"] == 0  # the sleep cleared the GPU cache either way
    assert (state["offload_tier_blocks"] > 0) is kept
    assert (await _answer(sim) == old) is kept
    assert _stale(sim) == (["offload_tier_stale_hit"] if kept else [])


async def test_release_kv_cache_memory_resets_the_caches_unless_034_keeps_the_tier(make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34", kv_connector=True)
    await _answer(sim)
    await sim.api.post("/pause")
    released = await sim.api.call("POST", "/release_kv_cache_memory", params={"reset_connector": "false"})
    assert released.body == {"status": "kv_cache_released"}
    state = await sim.state()
    assert (state["prefix_cache_blocks"], state["offload_tier_blocks"] > 0) == (0, True)


async def test_a_checkpoint_prepare_resets_the_tier(make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34", kv_connector=True)
    await _answer(sim)
    await sim.api.post("/checkpoint/prepare")
    assert (await sim.state())["offload_tier_blocks"] == 0


@pytest.mark.parametrize(("version", "after_wake"), [("0.33", 0), ("0.34", 16 * GIB)])
async def test_a_level_1_sleeps_host_backup_is_freed_at_the_wake_until_034_keeps_it_pinned(
    make_sim: SimFactory, version: str, after_wake: int
) -> None:
    """device_allocator/cumem.py: 0.33's wake_up drops the CPU backup, 0.34's keeps it (cudaHostRegister'd)."""
    sim = await make_sim(vllm_version=version)
    assert (await sim.state())["memory"]["host_bytes"] == 0
    await sim.api.sleep(1)
    assert (await sim.state())["memory"]["host_bytes"] == 16 * GIB  # the weights' size
    await sim.api.wake()
    assert (await sim.state())["memory"]["host_bytes"] == after_wake
    await sim.api.sleep(2)  # a discard releases the backup
    assert (await sim.state())["memory"]["host_bytes"] == 0
