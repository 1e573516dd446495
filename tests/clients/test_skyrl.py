"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0,
`skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`) through the proxy, in the
order SkyRL's trainer makes the calls:

* colocated start-up and steps: `WorkerDispatch.save_weights_for_sampler` (colocate_all) wakes the
  weights, pushes them (`CudaIpcTransferStrategy`: `skyrl_start_weight_update`, `update_weights_ipc`
  chunks, `skyrl_finish_weight_update`, with `reset_prefix_cache` started alongside by
  `FSDPPolicyWorker.broadcast_to_inference_engines`), then wakes the KV cache;
* non-colocated: `pause_generation` (`/pause?mode=keep&clear_cache=false`) ... `resume_generation`,
  with `update_weights_nccl` sent as a task while the trainer broadcasts (`BroadcastTransferStrategy`);
* colocated LoRA: `FSDPPolicyWorker._save_lora_adapters_and_sync` calls `load_lora_adapter`
  (`/skyrl/v1/load_lora_adapter`) between the two wakes; `sleep()` is forced to level 1.

The simulator serves SkyRL's server-wrapper routes and worker-extension RPCs (trainer_servers=skyrl)
and `/inference/v1/generate` (vLLM's `--enable-scale-out`).
"""

from __future__ import annotations

import asyncio
from abc import ABC
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients.conftest import Stack
from tests.clients.stand_ins import client_site, definitions, skyrl_remote_inference_client

SKYRL_SIM = {"trainer_servers": ("skyrl",), "enable_scale_out": True, "enable_lora": True}
# docs/guides/skyrl.md: the proxy learns from SkyRL's finish RPC that a level-2 sleep's weights are back.
SKYRL_PROXY = {"weight_reload_rpc_methods": ("reload_weights", "skyrl_finish_weight_update")}
CHUNK = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]], "ipc_handles_pickled": "x"}


@pytest.fixture
def skyrl() -> Any:
    return skyrl_remote_inference_client(client_site())


def broadcast_init_info(site: Path) -> Any:
    """SkyRL's `BroadcastInitInfo` (weight_sync/broadcast_strategy.py, next to torch and Ray imports)."""
    sync = site / "skyrl/backends/skyrl_train/weight_sync"
    namespace: dict[str, Any] = {"ABC": ABC, "dataclass": dataclass, "replace": replace}
    namespace.update({"List": list, "Dict": dict, "Any": Any, "Optional": Any})
    definitions(sync / "transfer_strategy.py", {"WeightSyncInitInfo"}, namespace)
    definitions(sync / "broadcast_strategy.py", {"BroadcastInitInfo"}, namespace)
    return namespace["BroadcastInitInfo"]


def client(skyrl: Any, stack: Stack, **extra: Any) -> Any:
    return skyrl.RemoteInferenceClient(
        proxy_url=stack.url, server_urls=[stack.url], data_parallel_size=1, model_name="tiny", **extra
    )


async def rollout(engine_client: Any, model: str | None = None, max_tokens: int = 6) -> dict[str, Any]:
    batch = {"prompt_token_ids": [[1, 45, 74]], "sampling_params": {"max_tokens": max_tokens, "logprobs": 0}}
    output = await engine_client.generate(batch, model=model)
    assert len(output["response_ids"][0]) == max_tokens, output
    assert output["stop_reasons"] == ["length"]
    assert len(output["response_logprobs"][0]) == max_tokens
    return dict(output)


async def colocated_weight_push(engine_client: Any, chunks: int = 2) -> None:
    """`save_weights_for_sampler` with colocate_all, full weights over CUDA IPC."""
    await engine_client.wake_up(tags=["weights"])
    cache_reset = asyncio.ensure_future(engine_client.reset_prefix_cache(reset_running_requests=True))
    await engine_client.start_weight_update(is_checkpoint_format=True)
    for _ in range(chunks):
        await engine_client.update_weights_ipc(CHUNK)
    await engine_client.finish_weight_update()
    await cache_reset
    await engine_client.wake_up(tags=["kv_cache"])


async def test_colocated_start_up_and_two_steps(skyrl: Any, make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(sim=SKYRL_SIM, **SKYRL_PROXY)
    init_info = broadcast_init_info(client_site())
    async with client(skyrl, stack) as engine_client:
        await engine_client.sleep(level=2)  # main_base: right after the servers come up
        assert await engine_client.get_world_size() == (1, 1)
        info = init_info(
            override_existing_receiver=True, master_addr="127.0.0.1", master_port=29500, rank_offset=1, world_size=2
        )
        await engine_client.init_weight_update_communicator(info)
        await colocated_weight_push(engine_client)  # the first sync, before the first rollout
        for _ in range(2):
            before = await rollout(engine_client)
            await engine_client.sleep(level=2)
            await colocated_weight_push(engine_client)
            after = await rollout(engine_client)
            assert after["response_ids"] != before["response_ids"], "the pushed weights were not in use"
    assert stack.sent("/sleep", "/wake_up")[:3] == [
        "POST /sleep?level=2",
        "POST /wake_up?tags=weights",
        "POST /wake_up?tags=kv_cache",
    ]
    await stack.assert_clean()


async def test_non_colocated_sync_holds_a_rollout_until_resume(
    skyrl: Any, make_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await make_stack(sim=SKYRL_SIM, **SKYRL_PROXY)
    async with client(skyrl, stack) as engine_client:
        await rollout(engine_client)
        await engine_client.pause_generation()
        held = asyncio.ensure_future(rollout(engine_client))
        await stack.wait_for(lambda s: s["held_requests"] == 1, "the rollout to be held")
        await engine_client.reset_prefix_cache()
        await engine_client.start_weight_update(is_checkpoint_format=True)
        update = asyncio.ensure_future(engine_client.update_weights_nccl({**CHUNK, "packed": True}))
        await update  # the trainer's broadcast would run here, concurrently
        await engine_client.finish_weight_update()
        assert not held.done()
        await engine_client.resume_generation()
        await asyncio.wait_for(held, timeout=10)
    assert stack.sent("/pause", "/resume") == ["POST /pause?mode=keep&clear_cache=false", "POST /resume"]
    await stack.assert_clean()


async def test_colocated_lora_sync_loads_the_adapter_between_the_wakes(
    skyrl: Any, make_stack: Callable[..., Awaitable[Stack]], adapter_dir: Callable[[str], str]
) -> None:
    stack = await make_stack(sim=SKYRL_SIM, **SKYRL_PROXY)
    name = skyrl.SKYRL_LORA_ADAPTER_NAME
    async with client(skyrl, stack, uses_lora_weight_sync=True) as engine_client:
        await engine_client.sleep(level=2)  # forced to level 1: LoRA keeps the base model
        for step in range(2):
            await engine_client.wake_up(tags=["weights"])
            cache_reset = asyncio.ensure_future(engine_client.reset_prefix_cache(reset_running_requests=True))
            loaded = await engine_client.load_lora_adapter(name, adapter_dir(f"step-{step}"))
            assert loaded[stack.url]["status"] == 200
            await cache_reset
            await engine_client.wake_up(tags=["kv_cache"])
            await rollout(engine_client, model=name)
            await engine_client.sleep()
        await engine_client.wake_up()
        await engine_client.unload_lora_adapter(name)
        with pytest.raises(ValueError, match="LoRA"):
            await engine_client.generate({"prompt_token_ids": [[1]], "sampling_params": {}})
    assert stack.sent("/sleep")[0] == "POST /sleep?level=1"
    assert stack.engine.lora_adapters == {}
    await stack.assert_clean()


async def test_generate_needs_vllm_started_with_scale_out(
    skyrl: Any, make_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await make_stack(sim={"trainer_servers": ("skyrl",)})
    async with client(skyrl, stack) as engine_client:
        with pytest.raises(aiohttp.ClientResponseError) as raised:
            await rollout(engine_client)
    assert raised.value.status == 403, "vLLM 0.32 serves /inference/v1/generate only with --enable-scale-out"
    assert "--enable-scale-out" in raised.value.message
    await stack.assert_clean()
