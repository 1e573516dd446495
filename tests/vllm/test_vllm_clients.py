"""The RL trainers' own client modules through the proxy in front of a real vLLM-for-CPU: the part of
tests/clients the CPU build can serve (it has no CUDA IPC or NCCL weight push).

* SkyRL 0.3.0 `RemoteInferenceClient`: `get_world_size`, `generate` (`/inference/v1/generate`, which vLLM
  0.32 serves only with `--enable-scale-out`: the suite's vLLM runs with it, scripts/vllm/vllm_server.py),
  and a colocated step without the weight push: `sleep(level=1)`, `wake_up(tags=["weights"])`,
  `reset_prefix_cache(reset_running_requests=True)`, `wake_up(tags=["kv_cache"])`, with a rollout sent
  while asleep held until the KV cache is back.
* TRL 1.16 `trl.generation.vllm_client.VLLMClient` (GRPO's server mode): start-up (`/health`,
  `/v1/models`), `get_server_info` (`/server_info?config_format=json`), batched `generate` with `n=2`
  (sampled: vLLM refuses `n>1` with greedy sampling) reading `token_ids`, `reset_prefix_cache`, and
  `init_communicator` stopping with TRL's own message because this vLLM has no weight-transfer engine.
* TRL 1.16 `trl.experimental.async_grpo.vllm_client.VLLMClient`: the start-up getters (`get_dtype` reads
  `/server_info`), `pause` / `resume` with a rollout held meanwhile.

The openai SDK is covered by test_vllm_inference.py and test_vllm_sleep.py. Answers through the proxy are
compared with the same client pointed at vLLM directly (greedy where the call allows it). The client packages come from
the cached site scripts/clients-site.sh installs; scripts/test-vllm.sh exports LIFEGUARD_CLIENTS_SITE.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients import stand_ins
from tests.lifeguard_testing import missing
from tests.vllm import vllm_e2e
from tests.vllm.vllm_e2e import (
    GREEDY,
    MODEL,
    PROMPT_IDS,
    engine_never_saw_it,
    lg_state,
    skyrl_client,
    vllm_flags,
    wait_held,
    wait_state,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(180),
    # The clients' own code, not ours: SkyRL's _get_session reads aiohttp's deprecated session.loop.
    pytest.mark.filterwarnings("ignore:client.loop property is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="session")
def installed_site() -> Path:
    """Session-scoped so that, without the packages, the tests skip before the shared vLLM starts."""
    path = os.environ.get(stand_ins.SITE_ENV, "")
    if not path or not Path(path).is_dir():
        missing(
            f"{stand_ins.SITE_ENV}={path!r} is not a directory: the trainers' client packages are not installed "
            "(scripts/test-vllm.sh installs them with scripts/clients-site.sh)"
        )
    return stand_ins.client_site()


@pytest.fixture
def site(installed_site: Path) -> Iterator[Path]:
    with stand_ins.modules_restored():
        yield installed_site


async def in_thread(trainer: Callable[[], Any], timeout: float = 60) -> Any:
    """TRL's clients are synchronous (`requests`): the trainer runs in a thread."""
    return await asyncio.wait_for(asyncio.to_thread(trainer), timeout=timeout)


def cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()


# ---------------------------------------------------------------- SkyRL


async def skyrl_rollout(engine_client: Any) -> dict[str, Any]:
    """vllm_e2e.skyrl_rollout, and SkyRL 0.3.0's answer says why it stopped and has a logprob per token."""
    output = await vllm_e2e.skyrl_rollout(engine_client)
    assert output["stop_reasons"] == ["length"]
    assert len(output["response_logprobs"][0]) == GREEDY["max_tokens"]
    return output


async def test_skyrl_generate_and_a_rollout_held_across_a_weights_only_wake(
    site: Path, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    skyrl = stand_ins.skyrl_remote_inference_client(site)
    async with skyrl_client(skyrl, vllm_server.url) as direct:
        expected = await skyrl_rollout(direct)
    async with skyrl_client(skyrl, proxy.url) as engine_client:
        assert await engine_client.get_world_size() == (1, 1)
        first = await skyrl_rollout(engine_client)
        assert (first["response_ids"], first["responses"]) == (expected["response_ids"], expected["responses"])

        await engine_client.sleep(level=1)
        held = asyncio.ensure_future(skyrl_rollout(engine_client))
        try:
            await wait_held(session, proxy.url, 1)
            await engine_client.wake_up(tags=["weights"])
            state = await lg_state(session, proxy.url)
            assert (state["state"], state["asleep_tags"], state["held_requests"]) == ("SLEEPING", ["kv_cache"], 1)
            assert (await vllm_flags(session, vllm_server.url))[0] is True  # vLLM: asleep until the KV cache is back
            await engine_never_saw_it(session, vllm_server.url)
            # SkyRL's colocated step resets the prefix cache between the wakes (alongside the weight push).
            reset = await engine_client.reset_prefix_cache(reset_running_requests=True)
            assert reset[proxy.url]["status"] == 200, reset
            assert not held.done()
            await engine_client.wake_up(tags=["kv_cache"])
            after = await asyncio.wait_for(held, 30)
        finally:
            cancel(held)
    assert after["response_ids"] == expected["response_ids"], "level 1 keeps the weights: the same greedy answer"
    state = await wait_state(session, proxy.url, "RUNNING")
    assert (state["asleep_tags"], state["held_requests"]) == ([], 0)


# ---------------------------------------------------------------- TRL


async def test_trl_server_mode_client_start_up_server_info_and_batched_generate(
    site: Path, proxy: Any, vllm_server: Any
) -> None:
    nccl = stand_ins.NcclSide()
    client_class = stand_ins.trl_server_mode_client(site, nccl)
    prompts = [PROMPT_IDS, PROMPT_IDS[:2]]

    def trainer(url: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        client = client_class(base_url=url, connection_timeout=10)
        info = client.get_server_info()
        # TRL's default sampling (temperature 1): vLLM refuses n>1 with greedy sampling (400).
        out = client.generate(prompts, n=2, max_tokens=5)
        return client.model, info, out

    direct_model, direct_info, direct_out = await in_thread(lambda: trainer(vllm_server.url))
    model, info, out = await in_thread(lambda: trainer(proxy.url))

    assert model == direct_model == MODEL
    assert info["model_config"]["dtype"] == direct_info["model_config"]["dtype"]
    assert info["model_config"]["dtype"].startswith("torch."), info["model_config"]["dtype"]
    # GRPOTrainer reads logprobs_mode from the same /server_info answer.
    assert info["model_config"]["logprobs_mode"] == direct_info["model_config"]["logprobs_mode"]
    for batch in (direct_out, out):
        assert batch["prompt_ids"] == prompts  # prompt-major: the n=2 completions of a prompt are adjacent
        assert [len(ids) for ids in batch["completion_ids"]] == [5, 5, 5, 5]
        # return_tokens_as_token_ids: each logprob names its token as "token_id:<id>", the sampled one first.
        assert [[ids[0] for ids in seq] for seq in batch["logprob_token_ids"]] == batch["completion_ids"]
        assert all(lps[0] <= 0 for seq in batch["logprobs"] for lps in seq)

    def weight_sync_start_up() -> None:
        client = client_class(base_url=proxy.url, connection_timeout=10)
        client.reset_prefix_cache()
        client.init_communicator(device="cuda:0")

    # This vLLM runs without --weight-transfer-config: TRL names the flag before any NCCL set-up.
    with pytest.raises(RuntimeError, match="--weight-transfer-config"):
        await in_thread(weight_sync_start_up)
    assert nccl.groups == []


async def trl_rollout(session: aiohttp.ClientSession, url: str) -> list[int]:
    """A rollout as `AsyncRolloutWorker._generate_one_turn` sends it (greedy here, to compare)."""
    body = {"model": MODEL, "prompt": PROMPT_IDS, "n": 1, "return_token_ids": True, **GREEDY}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    token_ids: list[int] = answer["choices"][0]["token_ids"]
    assert len(token_ids) == GREEDY["max_tokens"]
    return token_ids


async def test_trl_async_grpo_client_start_up_and_a_rollout_held_while_paused(
    site: Path, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    client_class = stand_ins.trl_async_grpo_client(site)
    direct, client = client_class(vllm_server.url, server_timeout=10), client_class(proxy.url, server_timeout=10)

    def start_up(c: Any) -> tuple[int, str, int]:
        c.wait_for_server_ready(poll_interval_s=0.05)
        return c.get_max_model_len(), c.get_dtype(), c.get_world_size()

    expected = await in_thread(lambda: start_up(direct))
    assert await in_thread(lambda: start_up(client)) == expected
    assert expected[0] == 16384 and expected[2] == 1

    before = await trl_rollout(session, proxy.url)
    await in_thread(lambda: client.pause(timeout=30))
    held = asyncio.ensure_future(trl_rollout(session, proxy.url))
    try:
        await wait_held(session, proxy.url, 1)
        assert (await vllm_flags(session, vllm_server.url))[1] is True
        await engine_never_saw_it(session, vllm_server.url)
        assert not held.done()
        await in_thread(lambda: client.resume(timeout=30))
        assert await asyncio.wait_for(held, 30) == before
    finally:
        cancel(held)
    state = await wait_state(session, proxy.url, "RUNNING")
    assert state["held_requests"] == 0
