"""SkyRL 0.4.0's own code through the proxy (`vllm-lifeguard serve`) in front of the simulator: every weight-sync
flow of `WorkerDispatch.save_weights_for_sampler`, with SkyRL's `RemoteInferenceClient` (rollouts, sleep, wake,
pause, its worker-extension RPCs) and its blocking `SkyrlWeightSyncClient` (vLLM's native weight-sync routes,
`Connection: close` on every call). See tests/clients/skyrl_trainer.py for what is SkyRL's code and what
stands in for Ray, torch and vLLM's trainer engines.

SkyRL 0.4.0 needs Python >= 3.12: `make test-clients` runs this file in a venv of its own
(scripts/clients-python.sh finds or builds the interpreter). Each flow must end as SkyRL expects, with no call
held behind one SkyRL sent itself (the trainer runs on a thread with a deadline; a hang is reported with the
proxy's state), no request reaching the engine while it was not ready (the simulator's violations), and no
5xx of the proxy's where vLLM would have answered.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from importlib.metadata import PathDistribution
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients.processes import ProcessStack, start_stack
from tests.clients.stand_ins import client_site, skyrl_remote_inference_client

SKYRL_VERSION = "0.4.0"
SKYRL_SIM = ("--trainer-server", "skyrl", "--enable-scale-out", "--enable-lora")
MODEL = "tiny"
NAMES = [f"model.layers.{i}.mlp.weight" for i in range(5)]
DRAFT = ["mtp.layers.0.weight"]
# A push with a drafter, as SkyRL's weight-sync client sends it: the target model's session, then the drafter's.
DRAFTED_PUSH = [
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
]
TRAINER_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def site() -> Path:
    if sys.version_info < (3, 12):
        pytest.fail("SkyRL 0.4.0 needs Python >= 3.12: `make test-clients` runs this file in its own venv")
    path = client_site()
    version = PathDistribution(next(path.glob("skyrl-*.dist-info"))).version
    assert version == SKYRL_VERSION, f"{path} holds skyrl {version}, not {SKYRL_VERSION}"
    return path


@pytest.fixture
def skyrl(site: Path) -> Any:
    return skyrl_remote_inference_client(site)


@pytest.fixture
def side(site: Path) -> Any:
    from tests.clients.skyrl_trainer import skyrl_trainer_side

    return skyrl_trainer_side(site)


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ProcessStack]]]:
    stacks: list[ProcessStack] = []

    async def make(*sim_args: str, drafter: bool = True, **proxy_env: str) -> ProcessStack:
        drafter_args = ("--draft-model",) if drafter else ()
        stack = await start_stack(tmp_path, (*SKYRL_SIM, *drafter_args, *sim_args), **proxy_env)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()  # also ends a trainer thread still blocked on a call


class ControlCalls:
    """Every call `SkyrlWeightSyncClient` made: what it sent and what came back (a `requests` response hook)."""

    def __init__(self, client: Any) -> None:
        self.seen: list[tuple[str, str | None, int]] = []
        client._session.hooks["response"].append(self._record)

    def _record(self, response: Any, *args: Any, **kwargs: Any) -> None:
        request = response.request
        path = request.path_url.split("?")[0]
        self.seen.append((path, request.headers.get("Connection"), response.status_code))

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.seen]

    def assert_all_closed_and_answered(self) -> None:
        assert self.seen, "SkyrlWeightSyncClient made no call"
        for path, connection, status in self.seen:
            assert connection == "close", (path, connection)
            assert status == 200, (path, status)


def remote_client(skyrl: Any, stack: ProcessStack, **extra: Any) -> Any:
    return skyrl.RemoteInferenceClient(
        proxy_url=stack.url, server_urls=[stack.url], data_parallel_size=1, model_name=MODEL, **extra
    )


def weight_sync_client(side: Any, stack: ProcessStack, backend: str = "nccl") -> Any:
    """What SkyRL's `build_trainer_engine` builds: per-server NCCL init payloads (`nccl_init_payloads`), none
    for IPC and delta."""
    plane = side.control_plane
    init_payload_fn = plane.nccl_init_payloads if backend == "nccl" else None
    return plane.SkyrlWeightSyncClient([stack.url], 1, init_payload_fn=init_payload_fn)


async def rollout(engine_client: Any, max_tokens: int = 6, model: str | None = None) -> dict[str, Any]:
    batch = {"prompt_token_ids": [[1, 45, 74]], "sampling_params": {"max_tokens": max_tokens, "logprobs": 0}}
    output = await engine_client.generate(batch, model=model)
    assert len(output["response_ids"][0]) == max_tokens, output
    assert output["stop_reasons"] == ["length"]
    return dict(output)


async def in_trainer(stack: ProcessStack, flow: Coroutine[Any, Any, Any], timeout: float = TRAINER_DEADLINE_S) -> Any:
    """SkyRL's driver code on a thread of its own, with its own event loop: its weight sync blocks that loop
    (`ray.get`), as it does in SkyRL. A sync that hangs is reported with the proxy's state."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(asyncio.run, flow), timeout)
    except TimeoutError:
        state = await stack.proxy_state()
        raise AssertionError(
            f"SkyRL's weight sync did not end within {timeout:g} s (a call held behind one it sent?): {state}\n"
            f"{stack.logs()}"
        ) from None


async def rollout_held_during_the_push(
    skyrl: Any, stack: ProcessStack, dispatch: Any, engine_client: Any, *, held_past_the_sync: bool = False
) -> None:
    """A weight sync in the trainer and a rollout sent once its push is under way: the rollout is held, then
    answered (`held_past_the_sync`: still unanswered when the sync has returned)."""
    trainer = asyncio.ensure_future(weight_sync(stack, dispatch, engine_client))
    await stack.wait_for(lambda s: s["weight_update_active"], "the weight push to start")
    async with remote_client(skyrl, stack) as generator:
        held = asyncio.ensure_future(rollout(generator))
        await stack.wait_for(lambda s: s["held_requests"] == 1, "the rollout to be held")
        await trainer
        if held_past_the_sync:
            assert not held.done()
        await asyncio.wait_for(held, timeout=10)


def nccl_driver(side: Any, skyrl: Any, stack: ProcessStack, **cfg: Any) -> tuple[Any, Any]:
    """SkyRL's non-colocated driver over NCCL, no drafter (`config(colocate_all=False, backend="nccl", **cfg)`):
    its dispatch and its engine client."""
    from tests.clients.skyrl_trainer import config

    sync_client = weight_sync_client(side, stack)
    engine = side.engine("nccl", sync_client, NAMES, draft=None, sim_url=stack.sim_url)
    return dispatch_for(side, skyrl, stack, config(colocate_all=False, backend="nccl", **cfg), engine)


async def weight_sync(stack: ProcessStack, dispatch: Any, engine_client: Any) -> None:
    """One `save_weights_for_sampler` of SkyRL's driver, in the trainer (in_trainer)."""

    async def step() -> None:
        async with engine_client:
            await dispatch.save_weights_for_sampler()

    await in_trainer(stack, step())


async def failing_weight_sync(stack: ProcessStack, dispatch: Any, engine_client: Any) -> BaseException | None:
    """`weight_sync` where the step fails, as it must (SkyRL's trainer stops on it): what it raised, or None."""

    async def step() -> BaseException | None:
        async with engine_client:
            try:
                await dispatch.save_weights_for_sampler()
            except Exception as exc:
                return exc
        return None

    failed: BaseException | None = await in_trainer(stack, step())
    return failed


def dispatch_for(side: Any, skyrl: Any, stack: ProcessStack, cfg: Any, engine: Any) -> tuple[Any, Any]:
    from tests.clients.skyrl_trainer import PolicyActorGroup

    engine_client = remote_client(skyrl, stack)
    group = PolicyActorGroup(side, cfg, engine, lambda: remote_client(skyrl, stack))
    dispatch = side.worker_dispatch(cfg, group, inference_engine_client=engine_client)
    return dispatch, engine_client


async def test_colocated_checks_is_sleeping_then_sleeps_pushes_model_and_drafter_and_wakes(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    from tests.clients.skyrl_trainer import config

    stack = await make_stack()
    sync_client = weight_sync_client(side, stack, "ipc")
    calls = ControlCalls(sync_client)
    engine = side.engine("ipc", sync_client, NAMES, draft=DRAFT, sim_url=stack.sim_url)
    dispatch, engine_client = dispatch_for(side, skyrl, stack, config(colocate_all=True, backend="ipc"), engine)
    dispatch.mark_all_offloaded()
    sync_client.init_weight_transfer_engine({"packed": True})  # vLLM's IPC trainer_init

    async def step() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with engine_client:
            before = await rollout(engine_client)
            await dispatch.save_weights_for_sampler()  # awake: /is_sleeping says no, so it sleeps first
            after = await rollout(engine_client)
            await engine_client.sleep()  # the colocated trainer sleeps the engine before it trains
            await dispatch.save_weights_for_sampler()  # asleep: /is_sleeping says so, no second sleep
            return before, after, await rollout(engine_client)

    before, after, third = await in_trainer(stack, step())
    assert after["response_ids"] != before["response_ids"], "the pushed weights were not in use"
    assert third["response_ids"] != after["response_ids"]
    sim = await stack.sim_state()
    assert sim["counters"]["sleep"] == 2, sim["counters"]
    assert sim["draft_weight_writes"] == 2 and sim["weight_writes"] == 2 * 3, sim  # 5 names in chunks of 2
    assert calls.paths().count("/start_draft_weight_update") == 2
    calls.assert_all_closed_and_answered()
    state = await stack.proxy_state()
    assert state["weights_stale"] is False and state["last_verification"]["checks"][-1]["name"] == "canary"
    await stack.assert_clean()


async def test_colocated_rollout_sent_mid_sync_is_held_until_the_kv_cache_wakes(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    from tests.clients.skyrl_trainer import config

    stack = await make_stack("--fault", "finish_weight_update:slow:1@2")
    sync_client = weight_sync_client(side, stack, "ipc")
    engine = side.engine("ipc", sync_client, NAMES, draft=None, sim_url=stack.sim_url)
    dispatch, engine_client = dispatch_for(side, skyrl, stack, config(colocate_all=True, backend="ipc"), engine)
    dispatch.mark_all_offloaded()

    await rollout_held_during_the_push(skyrl, stack, dispatch, engine_client, held_past_the_sync=True)
    await stack.assert_clean()  # and the engine never saw it before it was awake


async def test_non_colocated_fully_async_offload_freezes_rollouts_and_resumes_them_on_new_weights(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    from tests.clients.skyrl_trainer import config

    stack = await make_stack()
    sync_client = weight_sync_client(side, stack)
    calls = ControlCalls(sync_client)
    cfg = config(colocate_all=False, backend="nccl", offload_kv=True, fully_async=True)
    engine = side.engine("nccl", sync_client, NAMES, draft=DRAFT, sim_url=stack.sim_url)
    dispatch, engine_client = dispatch_for(side, skyrl, stack, cfg, engine)
    sync_client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2})

    async with remote_client(skyrl, stack) as generator:
        in_flight = asyncio.ensure_future(rollout(generator, max_tokens=400))  # frozen by the keep pause
        await stack.wait_sim(lambda s: s["running"] == 1, "the rollout to run")

        trainer = asyncio.ensure_future(weight_sync(stack, dispatch, engine_client))
        await stack.wait_for(lambda s: s.get("asleep_outside_vllm"), "the worker to free the engine's memory")
        late = asyncio.ensure_future(rollout(generator))
        await stack.wait_for(lambda s: s["held_requests"] == 1, "the new rollout to be held")
        await trainer
        await asyncio.wait_for(asyncio.gather(in_flight, late), timeout=20)
    sim = await stack.sim_state()
    assert sim["worker_asleep"] == [] and sim["weights_valid"], sim
    assert sim["counters"]["collective_rpc"] == 3  # sleep, wake weights, wake kv_cache
    assert sim["draft_weight_writes"] == 1
    calls.assert_all_closed_and_answered()
    state = await stack.proxy_state()
    assert state["last_verification"]["checks"][-1]["name"] == "canary"  # run at the /resume
    await stack.assert_clean()


async def test_a_failed_offload_sync_is_not_resumed_onto_the_freed_kv_cache(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    """The send fails after the weights woke: SkyRL skips the KV cache's wake and resumes in its `finally`. vLLM
    would schedule the frozen requests on the freed KV pool (an illegal memory access on a GPU); the proxy
    refuses the /resume and keeps them frozen."""

    stack = await make_stack("--fault", "start_weight_update:error500@1")
    dispatch, engine_client = nccl_driver(side, skyrl, stack, offload_kv=True, fully_async=True)

    failed = await failing_weight_sync(stack, dispatch, engine_client)
    assert isinstance(failed, aiohttp.ClientResponseError) and failed.status == 409, failed
    assert "skyrl_wake_for_weight_sync" in failed.message
    state = await stack.proxy_state()
    assert state["state"] == "SLEEPING" and state["asleep_tags"] == ["kv_cache"], state
    sim = await stack.sim_state()
    assert sim["violations"] == [] and sim["pause_state"] == "paused_all", sim


async def test_non_colocated_synchronous_offload_sleeps_and_wakes_through_vllm(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:

    stack = await make_stack()
    dispatch, engine_client = nccl_driver(side, skyrl, stack, offload_kv=True, fully_async=False)

    async def step() -> dict[str, Any]:
        async with engine_client:
            await dispatch.save_weights_for_sampler()
            return await rollout(engine_client)

    await in_trainer(stack, step())
    sim = await stack.sim_state()
    assert sim["counters"]["sleep"] == 1 and sim["counters"]["wake_up"] == 2, sim["counters"]
    await stack.assert_clean()


async def test_non_colocated_pause_push_with_drafter_resume_holds_a_rollout_until_resume(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    from tests.clients.skyrl_trainer import config

    stack = await make_stack("--fault", "finish_weight_update:slow:1@1")
    sync_client = weight_sync_client(side, stack)
    calls = ControlCalls(sync_client)
    engine = side.engine("nccl", sync_client, NAMES, draft=DRAFT, sim_url=stack.sim_url)
    dispatch, engine_client = dispatch_for(side, skyrl, stack, config(colocate_all=False, backend="nccl"), engine)

    await rollout_held_during_the_push(skyrl, stack, dispatch, engine_client)
    assert calls.paths() == DRAFTED_PUSH
    calls.assert_all_closed_and_answered()
    await stack.assert_clean()


async def test_delta_fetches_while_rollouts_run_then_reloads_model_and_drafter_inside_a_pause(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]], tmp_path: Path
) -> None:
    stack = await make_stack("--fault", "fetch_weights:slow:1@1")
    sync_client = weight_sync_client(side, stack, "delta")
    calls = ControlCalls(sync_client)
    init = side.delta_init_info(
        base_model_path=str(tmp_path / "base"),
        sync_dir=str(tmp_path / "sync"),
        local_checkpoint_dir=str(tmp_path / "local"),
        publish_staging_dir=str(tmp_path / "staging"),
        rank=0,
    )
    from tests.clients.skyrl_trainer import WeightSource

    engine = side.delta_engine.trainer_init(init, client=sync_client, source=WeightSource(NAMES))
    engine.skyrl_draft_source = WeightSource(DRAFT)
    engine.skyrl_set_reset_prefix_cache(True)
    update_info = {"target_version": 1, "sync_dir": str(tmp_path / "sync")}

    async with remote_client(skyrl, stack) as generator:
        trainer = asyncio.ensure_future(asyncio.to_thread(engine._apply_receiver_update, update_info))
        await stack.wait_sim(lambda s: s["counters"].get("fetch_weights", 0) == 1, "the fetch to start")
        answered = await asyncio.wait_for(rollout(generator), timeout=5)  # not held: the fetch is no sync
        assert not trainer.done() and answered["stop_reasons"] == ["length"]
        await asyncio.wait_for(trainer, timeout=TRAINER_DEADLINE_S)
        await rollout(generator)
    assert calls.paths() == [
        "/init_weight_transfer_engine",
        "/fetch_weights",
        "/pause",
        "/reset_prefix_cache",
        *DRAFTED_PUSH,
        "/resume",
    ]
    calls.assert_all_closed_and_answered()
    sim = await stack.sim_state()
    assert sim["fetched_versions"] == [1] and sim["draft_weight_writes"] == 1
    await stack.assert_clean()


async def test_a_drafter_update_on_a_vllm_without_a_drafter_gets_vllms_own_error(
    side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    stack = await make_stack(drafter=False)
    sync_client = weight_sync_client(side, stack)
    # vLLM's own error (its worker's message, passed on), not one of ours.
    with sync_client.draft_session(), pytest.raises(RuntimeError, match="no draft model is configured"):
        await asyncio.to_thread(sync_client.start_weight_update)
    state = await stack.proxy_state()
    assert state["weight_update_active"] is False, state  # no session believed open after vLLM refused it
    await stack.assert_clean()


async def test_fp8_kv_cache_nan_after_a_level_2_wake_is_caught_by_the_canary_not_served(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    """SkyRL's own code documents it (inference_servers/vllm_compat.py): with an FP8 KV cache on vLLM >= 0.26,
    discarded weights take the attention layers' `_q_scale` with them and the KV cache's wake leaves it 0.0;
    every completion after that "successful" wake has NaN logprobs. The canary after the full wake sees it: the
    wake is 503 verification_failed and rollouts are refused instead of trained on."""
    from tests.clients.skyrl_trainer import config

    stack = await make_stack("--fp8-kv-cache")
    sync_client = weight_sync_client(side, stack, "ipc")
    engine = side.engine("ipc", sync_client, NAMES, draft=None, sim_url=stack.sim_url)
    dispatch, engine_client = dispatch_for(side, skyrl, stack, config(colocate_all=True, backend="ipc"), engine)
    dispatch.mark_all_offloaded()

    failed = await failing_weight_sync(stack, dispatch, engine_client)
    assert isinstance(failed, aiohttp.ClientResponseError) and failed.status == 503, failed
    assert "canary" in failed.message and "non-finite logprob" in failed.message, failed.message
    state = await stack.proxy_state()
    canary = state["last_verification"]["checks"][-1]
    assert state["state"] == "FAILED" and canary["name"] == "canary" and canary["result"] == "fail", state
    async with remote_client(skyrl, stack) as generator:
        with pytest.raises(aiohttp.ClientResponseError) as refused:
            await rollout(generator)
    assert refused.value.status == 503


async def test_fp8_kv_cache_nan_after_the_worker_sleep_is_caught_at_the_resume(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    """The same loss through SkyRL's worker sleep (the weights discarded, `post_kv_cache_wake_up` on the KV
    cache's wake): the canary cannot run while paused, so it runs at the /resume."""

    stack = await make_stack("--fp8-kv-cache")
    dispatch, engine_client = nccl_driver(side, skyrl, stack, offload_kv=True, fully_async=True)

    failed = await failing_weight_sync(stack, dispatch, engine_client)
    assert isinstance(failed, aiohttp.ClientResponseError) and failed.status == 503, failed
    assert "resume" in failed.message and "non-finite logprob" in failed.message, failed.message
    state = await stack.proxy_state()
    assert state["state"] == "FAILED", state


async def test_a_rollout_after_the_fully_async_sync_never_reuses_the_old_weights_prefix(
    skyrl: Any, side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    """SkyRL's NCCL flow pauses with keep and sends no reset: a rollout kept across the sync holds KV blocks, so a
    reset could not succeed anyway (docs/verification.md, class 21). A rollout sharing a long prompt with one served
    before the sync must not be computed on the old weights' blocks (the simulator records any that is)."""

    stack = await make_stack(drafter=False)
    dispatch, engine_client = nccl_driver(side, skyrl, stack)
    shared = [[1, *range(40, 88)]]  # three of the simulator's 16-token blocks: a system prompt, say

    async with remote_client(skyrl, stack) as generator:
        params = {"max_tokens": 6, "logprobs": 0}
        await generator.generate({"prompt_token_ids": shared, "sampling_params": params})
        kept = asyncio.ensure_future(rollout(generator, max_tokens=3000))
        await stack.wait_sim(lambda s: s["running"] >= 1, "the long rollout to run")
        await weight_sync(stack, dispatch, engine_client)
        state = await stack.proxy_state()
        assert state["prefix_cache"]["partitioned"], state  # SkyRL sent no reset; the proxy's could not succeed
        after = await generator.generate({"prompt_token_ids": shared, "sampling_params": params})
        assert len(after["response_ids"][0]) == 6
        await asyncio.wait_for(kept, timeout=TRAINER_DEADLINE_S)
    await stack.assert_clean()


async def test_the_label_skyrls_control_plane_publishes_is_served_after_a_whole_sync_never_after_a_failed_chunk(
    side: Any, make_stack: Callable[..., Awaitable[ProcessStack]]
) -> None:
    """SkyRL 0.4 reads no weight version from the server: `RemoteInferenceClient.weight_version` counts its own syncs
    (the prefix-cache salt, generators/skyrl_gym_generator.py). It writes one: `SkyrlWeightSyncClient.
    finish_weight_update(weight_version)` (weight_sync/control_plane.py). A label it sends after a chunk that failed
    mid-way is refused, and `/weight_info` keeps the whole weights' label and says they are partial."""
    stack = await make_stack(drafter=False)
    client = weight_sync_client(side, stack, backend="ipc")
    failures: list[str] = []

    async def sync(label: str) -> None:
        client.start_weight_update()
        try:
            client.update_weights({"names": NAMES})
        except RuntimeError as exc:
            failures.append(f"update_weights: {exc}")
        try:
            client.finish_weight_update(weight_version=label)
        except RuntimeError as exc:
            failures.append(f"finish_weight_update: {exc}")

    async def weight_info() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"{stack.url}/weight_info") as response:
                assert response.status == 200, await response.text()
                info: dict[str, Any] = await response.json()
                return info

    client.init_weight_transfer_engine({})
    await in_trainer(stack, sync("step-1"))
    assert (failures, (await weight_info())["weight_version"]) == ([], "step-1")

    await stack.set_faults("update_weights:partial")
    await in_trainer(stack, sync("step-2"))
    assert [failure.split(":")[0] for failure in failures] == ["update_weights", "finish_weight_update"], failures
    assert "/update_weights" in failures[1], failures  # the finish's refusal names the chunk that failed
    info = await weight_info()
    assert (info["weight_version"], info["weights_partial"]) == ("step-1", True), info

    failures.clear()
    await in_trainer(stack, sync("step-3"))
    info = await weight_info()
    assert (failures, info["weight_version"], info["weights_partial"]) == ([], "step-3", False), info
    client.close()
    await stack.assert_clean()
