"""What SkyRL 0.4.0's weight sync sends, call by call, through the proxy in front of the simulator: the drafter's
weight update session, the worker RPCs that sleep and wake the engine's memory behind vLLM's executor,
`/fetch_weights` in every state, and weight pushes larger than an inference body may be.
(tests/clients/test_skyrl_0_4.py drives the same calls with SkyRL's own code.)"""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from lifeguard_sim.app import SimSettings

SKYRL = SimSettings(
    token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.01, trainer_servers=("skyrl",), draft_model=True
)


async def post(stack: Any, path: str, **kwargs: Any) -> Any:
    return await stack.client.post(path, **kwargs)


def rpc(method: str, **kwargs: Any) -> dict[str, Any]:
    return {"json": {"method": method, "kwargs": kwargs}}


async def test_a_drafter_session_after_the_models_is_a_session_of_its_own(make_stack: Any) -> None:
    stack = await make_stack(sim=SKYRL)
    await post(stack, "/sleep?level=2")
    await post(stack, "/wake_up?tags=weights")
    for start in ("/start_weight_update", "/start_draft_weight_update"):
        assert (await post(stack, start)).status == 200
        state = await stack.state()
        assert state["weight_update_target"] == ("drafter" if "draft" in start else "model"), state
        again = await post(stack, "/start_draft_weight_update")
        assert again.status == 409 and again.headers["X-Lifeguard-Reason"] == "weight_update_active"
        assert (await post(stack, "/update_weights", json={"update_info": {"names": []}})).status == 200
        # Before the fix the proxy forwarded the drafter's start at once, opened nothing, and refused this.
        assert (await post(stack, "/finish_weight_update")).status == 200
    assert stack.sim.draft_weight_writes == 1 and stack.sim.weight_update_active is False
    assert (await post(stack, "/wake_up?tags=kv_cache")).status == 200
    assert (await stack.state())["state"] == "RUNNING"
    assert stack.sim.violations == []


async def test_a_drafter_session_alone_does_not_bring_back_weights_a_level_2_sleep_discarded(make_stack: Any) -> None:
    stack = await make_stack(sim=SKYRL)
    await post(stack, "/sleep?level=2")
    await post(stack, "/wake_up?tags=weights")
    for path in ("/start_draft_weight_update", "/finish_weight_update", "/wake_up?tags=kv_cache"):
        assert (await post(stack, path)).status == 200, path
    state = await stack.state()
    assert state["state"] == "RUNNING" and state["weights_stale_reason"] == "discarded", state
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)  # the model's weights are still the discarded ones
    for path in ("/start_weight_update", "/finish_weight_update"):
        assert (await post(stack, path)).status == 200, path
    assert (await request).status == 200
    assert stack.sim.violations == []


async def test_the_worker_sleep_for_a_weight_sync_is_a_verified_sleep_vllm_does_not_know(make_stack: Any) -> None:
    stack = await make_stack(sim=SKYRL)
    used = stack.sim.memory.used_bytes
    early = await post(stack, "/collective_rpc", **rpc("skyrl_sleep_for_weight_sync"))
    assert early.status == 409 and early.headers["X-Lifeguard-Reason"] == "not_paused"  # never sent to vLLM
    assert stack.sim.memory.used_bytes == used
    assert (await post(stack, "/pause?mode=keep&clear_cache=false")).status == 200
    slept = await post(stack, "/collective_rpc", **rpc("skyrl_sleep_for_weight_sync", offload_kv=True))
    assert slept.status == 200 and "memory=pass" in slept.headers["X-Lifeguard-Verified"]
    state = await stack.state()
    assert state["state"] == "SLEEPING" and state["asleep_outside_vllm"] and state["weights_stale"], state
    assert stack.sim.is_paused and not stack.sim.executor_tags  # vLLM's own flags: only paused
    # vLLM's /wake_up and /resume would resume scheduling on the freed memory: refused, never sent.
    for path in ("/wake_up", "/resume", "/sleep?level=1"):
        refused = await post(stack, path)
        assert refused.status == 409 and "skyrl_wake_for_weight_sync" in (await refused.json())["error"]["message"]
    again = await post(stack, "/collective_rpc", **rpc("skyrl_sleep_for_weight_sync"))
    assert again.status == 200 and again.headers["X-Lifeguard-Noop"] == "true"
    woke = await post(stack, "/collective_rpc", **rpc("skyrl_wake_for_weight_sync", tags=["weights"]))
    assert woke.status == 200 and "memory=pass" in woke.headers["X-Lifeguard-Verified"]
    for path in ("/start_weight_update", "/finish_weight_update"):
        assert (await post(stack, path)).status == 200, path
    await post(stack, "/collective_rpc", **rpc("skyrl_wake_for_weight_sync", tags=["kv_cache"]))
    state = await stack.state()
    assert state["state"] == "PAUSED" and not state["asleep_outside_vllm"] and not state["weights_stale"], state
    resumed = await post(stack, "/resume")
    assert resumed.status == 200 and "canary=pass" in resumed.headers["X-Lifeguard-Verified"]
    assert (await stack.completion()).status == 200
    assert stack.sim.violations == []


async def test_fetch_weights_is_forwarded_at_once_awake_paused_and_asleep(make_stack: Any) -> None:
    stack = await make_stack(sim=SKYRL)
    assert (await post(stack, "/init_weight_transfer_engine", json={"init_info": {}})).status == 200
    for version, before in enumerate(("/resume", "/pause?mode=keep", "/sleep?level=2"), start=1):
        await post(stack, before)
        fetched = await post(stack, "/fetch_weights", json={"target_version": version})
        assert fetched.status == 200, await fetched.text()
    assert stack.sim.fetched_versions == {1, 2, 3}
    # It never waits behind a lifecycle call in progress: a slow wake does not hold it. Answered while vLLM still
    # sleeps in that wake (a fetch held behind it would reach vLLM only once the wake had ended there).
    stack.faults("wake_up:slow:3")
    wake = asyncio.ensure_future(post(stack, "/wake_up"))
    await stack.wait_state("WAKING")
    fetched = await asyncio.wait_for(post(stack, "/fetch_weights", json={"target_version": 4}), 20)
    assert fetched.status == 200 and stack.sim.is_sleeping and not wake.done()
    assert (await wake).status == 200
    assert stack.sim.violations == []


async def test_a_weight_push_may_be_larger_than_an_inference_body(make_stack: Any) -> None:
    stack = await make_stack(sim=SKYRL, max_body_bytes=64 * 1024, max_weight_update_body_bytes=1024 * 1024)
    assert (await post(stack, "/start_weight_update")).status == 200
    handles = "h" * (512 * 1024)  # an unpacked CUDA IPC push: one pickled handle per parameter and GPU
    body = json.dumps({"update_info": {"names": ["w"], "ipc_handles_pickled": handles}}).encode()
    pushed = await post(stack, "/update_weights", data=io.BytesIO(body), headers={"Content-Type": "application/json"})
    assert pushed.status == 200, await pushed.text()
    assert (await post(stack, "/finish_weight_update")).status == 200
    too_big = await stack.client.post("/v1/completions", data=io.BytesIO(b"x" * (128 * 1024)))
    assert too_big.status == 413
    beyond = await post(stack, "/collective_rpc", data=io.BytesIO(b" " * (2 * 1024 * 1024)))
    assert beyond.status == 413 and beyond.headers["X-Lifeguard-Reason"] == "body_too_large"
    assert stack.sim.violations == []


async def test_a_round_armed_for_a_lora_adapter_builds_it_and_leaves_the_models_weights_as_they_were(
    make_stack: Any, tmp_path: Any
) -> None:
    """SkyRL 0.4.0's `lora.sync_mode=memory` (megatron_worker.py): arm the round, push the adapter's tensors
    through the weight transfer, then register it from them."""
    lora = SimSettings(**{**SKYRL.__dict__, "enable_lora": True})
    stack = await make_stack(sim=lora)
    assert (await post(stack, "/init_weight_transfer_engine", json={"init_info": {}})).status == 200
    await post(stack, "/sleep?level=2")  # the base weights discarded: only the model's own push brings them back
    await post(stack, "/wake_up?tags=weights")
    target = {"receive_target": {"kind": "lora", "lora_name": "skyrl-lora", "adapter_config": {}, "aliases": {}}}
    assert (await post(stack, "/collective_rpc", **rpc("skyrl_set_lora_receive_target", **target))).status == 200
    assert (await post(stack, "/start_weight_update")).status == 200
    assert (await stack.state())["weight_update_target"] == "lora_adapter"
    assert (await post(stack, "/update_weights", json={"update_info": {"names": ["lora_A"]}})).status == 200
    assert (await post(stack, "/finish_weight_update")).status == 200
    assert (await stack.state())["weights_stale_reason"] == "discarded"
    loaded = await post(stack, "/skyrl/v1/load_lora_adapter", json={"lora_name": "skyrl-lora", "in_memory": True})
    assert loaded.status == 200, await loaded.text()
    assert stack.sim.lora_adapters == {"skyrl-lora": "skyrl-memory://skyrl-lora"}
    gone = await post(stack, "/collective_rpc", **rpc("skyrl_discard_in_memory_lora", lora_name="skyrl-lora"))
    assert gone.status == 200 and stack.sim.staged_adapters == set()
    assert stack.sim.violations == []
