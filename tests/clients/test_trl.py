"""TRL 1.16's own HTTP clients through the proxy, in the order TRL's trainers call them:

* `trl.experimental.async_grpo.vllm_client.VLLMClient`, driven as `WeightTransferClient`
  (`weight_transfer.py`: `init_weight_transfer`, `send_weights`, `pause`, `resume`) and
  `AsyncGRPOTrainer` (`_sync_weight_merged`; `_sync_weight_lora`: pause, `/v1/load_lora_adapter`,
  resume, `/v1/unload_lora_adapter` of the stale adapter) make it, with a rollout held meanwhile;
* `trl.generation.vllm_client.VLLMClient` (GRPO `vllm_mode="server"` against `vllm serve`): start-up
  (`/health`, `/v1/models`), `init_communicator` (`/server_info?config_format=json`, `/get_world_size`,
  `/init_weight_transfer_engine`), `weight_update()` with `update_named_params`, `reset_prefix_cache`,
  and batched `generate` with `n>1` reading `token_ids`.

Both are synchronous (`requests`), so the trainer runs in a thread. The NCCL tensor path is vLLM's,
stood in for by `stand_ins.NcclSide`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.clients.conftest import Stack
from tests.clients.stand_ins import NcclSide, client_site, trl_async_grpo_client, trl_server_mode_client
from tests.lifeguard_testing import client_timeout

UPDATE_INFO = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}


@pytest.fixture
def async_grpo_client() -> Any:
    return trl_async_grpo_client(client_site())


@pytest.fixture
def nccl() -> NcclSide:
    return NcclSide()


@pytest.fixture
def server_mode_client(nccl: NcclSide) -> Any:
    return trl_server_mode_client(client_site(), nccl)


async def in_thread(trainer: Callable[[], Any], timeout: float = 60) -> Any:
    return await asyncio.wait_for(asyncio.to_thread(trainer), timeout=timeout)


async def completion(stack: Stack, model: str = "tiny") -> dict[str, Any]:
    """A rollout as `AsyncRolloutWorker._generate_one_turn` sends it."""
    import aiohttp

    body = {"model": model, "prompt": [1, 45, 74], "max_tokens": 6, "n": 1, "return_token_ids": True, "logprobs": 0}
    async with (
        aiohttp.ClientSession(timeout=client_timeout()) as session,
        session.post(f"{stack.url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
    assert len(answer["choices"][0]["token_ids"]) == 6
    return answer


async def test_async_grpo_start_up_and_merged_weight_syncs_hold_a_rollout(
    async_grpo_client: Any, make_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await make_stack()
    client = async_grpo_client(stack.url, server_timeout=10)

    def start_up() -> tuple[int, str, int]:
        client.wait_for_server_ready(poll_interval_s=0.05)
        init = {"master_address": "127.0.0.1", "master_port": 29551, "rank_offset": 1, "world_size": 2, "packed": True}
        client.init_weight_transfer_engine(init)
        return client.get_max_model_len(), client.get_dtype(), client.get_world_size()

    assert await in_thread(start_up) == (16384, "torch.bfloat16", 1)
    for _ in range(2):
        await completion(stack)
        await in_thread(lambda: client.pause(timeout=10))
        held = asyncio.ensure_future(completion(stack))
        await stack.wait_for(lambda s: s["held_requests"] == 1, "the rollout to be held")

        def send_weights() -> None:
            client.start_weight_update(timeout=10)
            client.update_weights(UPDATE_INFO, timeout=10)
            client.finish_weight_update(timeout=10)

        await in_thread(send_weights)
        assert not held.done()
        await in_thread(lambda: client.resume(timeout=10))
        await asyncio.wait_for(held, timeout=10)
    sync = ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
    paths = [p.split(" ")[1] for p in stack.sent(*(s.split("?")[0] for s in sync))]
    assert paths == sync * 2
    await stack.assert_clean()


async def test_async_grpo_lora_sync_publishes_versioned_adapters(
    async_grpo_client: Any, make_stack: Callable[..., Awaitable[Stack]], adapter_dir: Callable[[str], str]
) -> None:
    """`AsyncGRPOTrainer._sync_weight_lora` with max_staleness=0: load v{N} while paused, then unload v{N-1}."""
    stack = await make_stack(sim={"enable_lora": True})
    client = async_grpo_client(stack.url, server_timeout=10)
    for version in (1, 2, 3):
        await in_thread(lambda: client.pause(timeout=10))

        def publish(version: int = version) -> None:
            client.load_lora_adapter(f"policy-v{version}", adapter_dir(f"policy-v{version}"), timeout=10)
            client.resume(timeout=10)
            if version - 1 > 0:
                client.unload_lora_adapter(f"policy-v{version - 1}", timeout=10)

        await in_thread(publish)
        await completion(stack, model=f"policy-v{version}")
    assert list(stack.engine.lora_adapters) == ["policy-v3"]
    await stack.assert_clean()


async def test_server_mode_client_start_up_weight_update_and_batched_generate(
    server_mode_client: Any, nccl: NcclSide, make_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await make_stack()

    def trainer() -> dict[str, Any]:
        client = server_mode_client(base_url=stack.url, connection_timeout=10)
        assert client.model == "tiny"
        client.init_communicator(device="cuda:0")
        with client.weight_update():
            client.update_named_params([("w", "bfloat16", [4, 4])], iter([("w", object())]))
        client.reset_prefix_cache()
        return dict(client.generate([[1, 45, 74], [1, 45]], n=2, max_tokens=5))

    out = await in_thread(trainer)
    assert out["prompt_ids"] == [[1, 45, 74], [1, 45]]
    assert [len(ids) for ids in out["completion_ids"]] == [5, 5, 5, 5]
    assert [len(lps) for lps in out["logprobs"]] == [5, 5, 5, 5]
    assert out["logprob_token_ids"][0][0][0] == out["completion_ids"][0][0]
    assert nccl.groups[0]["world_size"] == 2 and nccl.broadcast == ["w"]
    assert stack.sent("/start_weight_update", "/update_weights", "/finish_weight_update") == [
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
    ]
    await stack.assert_clean()
