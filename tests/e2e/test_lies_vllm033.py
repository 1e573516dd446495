"""The "200 lies" of vLLM 0.33 and the newest field reports (docs/verification.md, items 12-16), end to end.

The proxy in front of the simulator's 0.33 profile (and 0.32 where they differ): a LoRA adapter lost in a wake
(vLLM #53888, `wake_up:lose-lora`), elastic EP's scaling gate and retired ranks (never trusted from /health), and
vLLM's own pause refusing requests (`engine_paused`), adopted as a pause the proxy did not make.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientTimeout

from lifeguard_sim.app import SimSettings
from proxy.upstream.refusals import Refusal, RefusalKind, response_refusal, stream_refusal
from tests.e2e.conftest import FAST_SIM, Stack

LORA_SIM = SimSettings(**{**FAST_SIM.__dict__, "enable_lora": True})
CANARY = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 1}


async def _answer(stack: Stack, model: str) -> tuple[int, Any]:
    resp = await stack.client.post("/v1/completions", json={"model": model, **CANARY})
    body = await resp.json()
    return resp.status, body["choices"][0]["text"] if resp.status == 200 else body


async def _load_adapter(stack: Stack, path: Path, *, again: bool = False) -> None:
    body = {"lora_name": "sql", "lora_path": str(path), "load_inplace": again}
    resp = await stack.client.post("/v1/load_lora_adapter", json=body)
    assert resp.status == 200, await resp.text()


def _adapter_dir(tmp_path: Path) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    return tmp_path


# ----- 12: a LoRA adapter lost in a wake (vLLM #53888)


async def _adapter_served(stack: Stack, tmp_path: Path) -> tuple[Any, Any]:
    """Adapter `sql` loaded, answering apart from the base model, its canary recorded: the base's and its answers."""
    await _load_adapter(stack, _adapter_dir(tmp_path))
    base, tuned = await _answer(stack, "tiny"), await _answer(stack, "sql")
    assert tuned != base
    await stack.wait_for(lambda s: s["lora_adapters"].get("sql", {}).get("canary_recorded") is True, timeout=5)
    return base, tuned


async def _failed_until_loaded_again(stack: Stack, tmp_path: Path, tuned: Any) -> None:
    """FAILED `lora` naming `sql`, then the way back, as after a level-1 wake: the adapter loaded again."""
    snapshot = await stack.state()
    assert (snapshot["state"], snapshot["failure"], snapshot["lost_lora_adapters"]) == ("FAILED", "lora", ["sql"])
    await _load_adapter(stack, tmp_path, again=True)
    await stack.wait_state("RUNNING", timeout=5 * stack.settings.reconcile_interval_s + 2)
    assert await _answer(stack, "sql") == tuned
    assert stack.sim.state_dict()["violations"] == []


async def test_12_a_lora_adapter_lost_in_the_wake_fails_the_wake_naming_it_until_it_is_loaded_again(
    make_stack: Any, tmp_path: Path
) -> None:
    stack: Stack = await make_stack(LORA_SIM)
    base, tuned = await _adapter_served(stack, tmp_path)
    assert (await stack.client.post("/sleep?level=1")).status == 200
    stack.faults("wake_up:lose-lora")

    wake = await stack.client.post("/wake_up")
    assert wake.status == 503
    error = (await wake.json())["error"]
    assert error["reason"] == "verification_failed"
    assert "adapter 'sql' answers" in error["message"] and "as the base model does" in error["message"]
    snapshot = await stack.state()
    failed = [c for c in snapshot["last_verification"]["checks"] if c["result"] == "fail"]
    assert [(c["name"], c["value"]) for c in failed] == [("lora", ["sql"])]
    assert (snapshot["state"], snapshot["failure"], snapshot["lost_lora_adapters"]) == ("FAILED", "lora", ["sql"])

    refused = await stack.completion(model="sql")  # nothing is served on an engine that lies about an adapter
    assert refused.status == 503
    refusal = (await refused.json())["error"]
    assert refusal["reason"] == "engine_unavailable" and "'sql'" in refusal["message"]

    await _load_adapter(stack, tmp_path, again=True)  # control calls pass: the way back is through them
    await stack.wait_state("RUNNING", timeout=5 * stack.settings.reconcile_interval_s + 2)
    assert await _answer(stack, "sql") == tuned
    assert stack.sim.state_dict()["violations"] == []


async def test_12_an_adapter_unloaded_behind_the_proxys_back_during_the_sleep_is_named_too(
    make_stack: Any, tmp_path: Path
) -> None:
    stack: Stack = await make_stack(LORA_SIM)
    await _load_adapter(stack, _adapter_dir(tmp_path))
    await stack.wait_for(lambda s: "sql" in s["lora_adapters"], timeout=5)
    assert (await stack.client.post("/sleep?level=1")).status == 200
    stack.sim.unload_lora_adapter("sql")
    wake = await stack.client.post("/wake_up")
    assert wake.status == 503
    assert "adapter 'sql' (loaded from" in (await wake.json())["error"]["message"]


async def test_12_a_lora_reload_inside_the_weight_sync_is_not_a_loss(make_stack: Any, tmp_path: Path) -> None:
    """SkyRL's order: wake the weights, load the new adapter, wake the KV cache. The adapter answers otherwise after
    the wake on purpose; the load went through the proxy, so nothing is compared against the old answer."""
    stack: Stack = await make_stack(LORA_SIM)
    first, second = tmp_path / "v1", tmp_path / "v2"
    first.mkdir()
    second.mkdir()
    await _load_adapter(stack, _adapter_dir(first))
    await stack.wait_for(lambda s: s["lora_adapters"].get("sql", {}).get("canary_recorded") is True, timeout=5)
    assert (await stack.client.post("/sleep?level=1")).status == 200
    assert (await stack.client.post("/wake_up?tags=weights")).status == 200
    await _load_adapter(stack, _adapter_dir(second), again=True)
    wake = await stack.client.post("/wake_up?tags=kv_cache")
    assert wake.status == 200, await wake.text()
    assert "lora" not in wake.headers["X-Lifeguard-Verified"]


async def test_12_an_adapter_lost_in_the_wake_after_a_level_2_sleep_is_not_served_as_the_base_model(
    make_stack: Any, tmp_path: Path
) -> None:
    """Found with issue 49: on vLLM-for-CPU the adapter survives a level-2 cycle (tests/vllm/test_vllm_lora.py), but
    the wake that loses it (vLLM #53888, the simulator's `lose-lora`) after a level-2 sleep goes unseen: the wake
    cannot run a canary on discarded weights, the reload brings the base weights back, and the adapter, still
    listed, answers as the base model. The reload now checks the adapters recorded when the sleep began, while inference
    is still held: one that answered apart from the base model then and as it now is lost, as after a level-1 wake."""
    stack: Stack = await make_stack(LORA_SIM)
    base, tuned = await _adapter_served(stack, tmp_path)
    assert (await stack.client.post("/sleep?level=2")).status == 200
    stack.faults("wake_up:lose-lora")
    assert (await stack.client.post("/wake_up")).status == 200  # awake on discarded weights: held until a reload

    reload = await stack.client.post("/collective_rpc", json={"method": "reload_weights"})

    answer = await _answer(stack, "sql")
    assert answer != base, f"after the reload ({reload.status}) the adapter is served answering as the base model"
    assert reload.status == 503
    error = (await reload.json())["error"]
    assert error["reason"] == "verification_failed" and "adapter 'sql' answers" in error["message"]
    assert answer[0] == 503
    await _failed_until_loaded_again(stack, tmp_path, tuned)


async def test_12_an_adapter_lost_in_skyrls_level_2_order_is_caught_at_the_kv_cache_wake(
    make_stack: Any, tmp_path: Path
) -> None:
    """SkyRL's order after a level-2 sleep: wake the weights, reload them, then wake the KV cache. The reload cannot
    check the adapters (no completion runs while the KV cache sleeps), so the KV cache's wake does, inference still
    held: an adapter that answers as the base model is lost, never served."""
    stack: Stack = await make_stack(LORA_SIM)
    base, tuned = await _adapter_served(stack, tmp_path)
    assert (await stack.client.post("/sleep?level=2")).status == 200
    stack.faults("wake_up:lose-lora")
    assert (await stack.client.post("/wake_up?tags=weights")).status == 200
    reload = await stack.client.post("/collective_rpc", json={"method": "reload_weights"})
    assert reload.status == 200, await reload.text()  # the KV cache sleeps: nothing can answer a canary yet

    wake = await stack.client.post("/wake_up?tags=kv_cache")

    answer = await _answer(stack, "sql")
    assert answer != base, f"after the KV cache's wake ({wake.status}) the adapter answers as the base model"
    assert wake.status == 503
    error = (await wake.json())["error"]
    assert error["reason"] == "verification_failed" and "adapter 'sql'" in error["message"], error
    await _failed_until_loaded_again(stack, tmp_path, tuned)


# ----- 13: elastic EP scaling, never trusted from /health


async def test_13_a_scale_through_the_proxy_shows_scaling_and_holds_inference_instead_of_vllms_503(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(SimSettings(**{**FAST_SIM.__dict__, "scale_seconds": 1.5}))
    scale = asyncio.ensure_future(stack.client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2}))
    snapshot = await stack.wait_state("SCALING", timeout=3)
    assert snapshot["elastic_ep"]["phase"] == "committing" and snapshot["elastic_ep"]["verdict"] == "scaling"
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    resp = await asyncio.wait_for(scale, 10)
    assert resp.status == 200
    answer = await asyncio.wait_for(held, 10)
    assert answer.status == 200, await answer.text()
    await stack.wait_state("RUNNING")


@pytest.mark.parametrize("version", ["0.32", "0.33"])
async def test_13_a_scale_behind_the_proxys_back_is_scaling_not_a_dead_engine(make_stack: Any, version: str) -> None:
    """0.32's gate answers /health 503 too: without the status it would look like a dead engine."""
    sim = SimSettings(**{**FAST_SIM.__dict__, "scale_seconds": 30.0, "vllm_version": version})
    stack: Stack = await make_stack(sim)
    scale = asyncio.ensure_future(stack.sim.scale_elastic_ep(2))
    try:
        snapshot = await stack.wait_state("SCALING", timeout=5 * stack.settings.reconcile_interval_s + 1)
        assert snapshot["failure"] is None
        assert (await stack.client.get("/lifeguard/readyz")).status == 200  # held while it scales, as while asleep
        sleep = await stack.client.post("/sleep")
        assert sleep.status == 503 and (await sleep.json())["error"]["reason"] == "engine_scaling"
        await _held_then_released_on_restart(stack)
    finally:
        scale.cancel()


async def _held_then_released_on_restart(stack: Stack) -> None:
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    stack.sim.restart()  # the gate goes down (a fresh process)
    answer = await asyncio.wait_for(held, 10)
    assert answer.status == 200


async def test_13_a_failed_scale_fails_the_engine_with_vllms_error(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    stack.faults("scale_elastic_ep:scale-fails")
    resp = await stack.client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert resp.status == 500  # vLLM's own answer to the control call
    snapshot = await stack.wait_state("FAILED", timeout=5 * stack.settings.reconcile_interval_s + 1)
    assert snapshot["failure"] == "elastic_ep"
    assert "did not reach the commit barrier" in snapshot["last_error"]["message"]
    refused = await stack.completion()
    assert (
        refused.status == 503 and "scale to 2 data-parallel ranks failed" in (await refused.json())["error"]["message"]
    )


# ----- 14: a retired data-parallel rank answers /health 200 and nothing else


async def test_14_a_retired_rank_is_failed_retired_though_its_health_is_200(make_stack: Any) -> None:
    sim = SimSettings(**{**FAST_SIM.__dict__, "data_parallel_size": 2, "data_parallel_rank": 1})
    stack: Stack = await make_stack(sim, hold_timeout_s=30)
    resp = await stack.client.post("/scale_elastic_ep", json={"new_data_parallel_size": 1})
    assert resp.status == 200
    async with aiohttp.ClientSession(timeout=ClientTimeout(total=10)) as direct:
        async with direct.get(stack.sim_server.make_url("/health")) as health:
            assert health.status == 200  # vLLM says healthy...
    snapshot = await stack.wait_for(lambda s: s["failure"] == "retired", timeout=5)
    assert snapshot["state"] == "FAILED"  # ...the proxy does not
    assert (await stack.client.get("/lifeguard/readyz")).status == 503
    refused = await stack.completion()
    assert refused.status == 503
    error = (await refused.json())["error"]
    assert error["reason"] == "engine_retired" and "retired" in error["message"]
    control = await stack.client.post("/reset_prefix_cache")
    assert (control.status, (await control.json())["error"]["reason"]) == (503, "engine_retired")


async def test_14_requests_held_when_the_rank_retires_are_answered_at_once_not_at_their_deadline(
    make_stack: Any,
) -> None:
    sim = SimSettings(**{**FAST_SIM.__dict__, "data_parallel_size": 2, "data_parallel_rank": 1})
    stack: Stack = await make_stack(sim, hold_timeout_s=60, reconcile_interval_s=0.2)
    assert (await stack.client.post("/sleep?level=1")).status == 200
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    stack.sim.elastic_retired = True  # a scale-down sent to vLLM directly, while the proxy held it asleep
    answer = await asyncio.wait_for(held, 5 * stack.settings.reconcile_interval_s + 2)
    assert answer.status == 503 and (await answer.json())["error"]["reason"] == "engine_retired"


# ----- 15: vLLM's own pause refuses requests (vLLM >= 0.33's engine_paused)


async def test_15_the_detector_recognises_what_the_033_simulator_sends_while_paused(make_stack: Any) -> None:
    stack: Stack = await make_stack(reconcile_interval_s=60)
    await stack.sim.pause("abort")
    url = str(stack.sim_server.make_url("/v1/completions"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=ClientTimeout(total=10)) as direct:
        async with direct.post(url, json=body) as resp:
            plain = response_refusal(resp.status, list(resp.raw_headers), await resp.read())
        async with direct.post(url, json={**body, "stream": True}) as resp:
            streamed = stream_refusal(resp.status, list(resp.raw_headers), await resp.read())
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with direct.post(str(stack.sim_server.make_url("/v1/chat/completions")), json=chat) as resp:
            chat_streamed = stream_refusal(resp.status, list(resp.raw_headers), await resp.read())
    assert plain is not None and plain.kind is RefusalKind.ENGINE_PAUSED
    assert streamed == plain and chat_streamed == plain


async def test_15_a_pause_found_through_a_refusal_is_adopted_and_released_by_resume(make_stack: Any) -> None:
    """What the data plane does with a refused request: it tells the coordinator, which adopts the pause a trainer
    sent straight to vLLM (SkyRL, prime-rl); the request is then held like any, and released by /resume."""
    stack: Stack = await make_stack(reconcile_interval_s=60)  # no reconcile round gets there first
    await stack.sim.pause("abort")
    coordinator = stack.engine.coordinator
    state = await coordinator.engine_refused(Refusal(RefusalKind.ENGINE_PAUSED, "Generation is paused."))
    assert state.value == "PAUSED"
    snapshot = await stack.state()
    assert snapshot["drift_events"][-1]["cause"] == "engine_paused"
    assert snapshot["pause_mode"] == "abort"
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert (await stack.client.post("/resume")).status == 200
    answer = await asyncio.wait_for(held, 10)
    assert answer.status == 200, await answer.text()
    assert stack.sim_count("generate") == 1  # released once, after the resume: never refused by vLLM


async def test_15_a_refusal_when_vllm_is_not_paused_any_more_leaves_the_engine_running(make_stack: Any) -> None:
    stack: Stack = await make_stack(reconcile_interval_s=60)
    coordinator = stack.engine.coordinator
    state = await coordinator.engine_refused(Refusal(RefusalKind.ENGINE_PAUSED, "Generation is paused."))
    assert state.value == "RUNNING" and (await stack.state())["drift_events"] == []


async def test_15_an_elastic_refusal_is_adopted_as_scaling(make_stack: Any) -> None:
    stack: Stack = await make_stack(
        SimSettings(**{**FAST_SIM.__dict__, "scale_seconds": 30.0}), reconcile_interval_s=60
    )
    scale = asyncio.ensure_future(stack.sim.scale_elastic_ep(2))
    try:
        await stack.wait_for(lambda _: stack.sim.elastic_scaling, timeout=5)  # vLLM's gate is up
        coordinator = stack.engine.coordinator
        state = await coordinator.engine_refused(Refusal(RefusalKind.ELASTIC_EP, "scaling"))
        assert state.value == "SCALING"
    finally:
        scale.cancel()


async def test_15_a_request_vllm_refuses_because_a_trainer_paused_it_directly_is_held_not_passed_on(
    make_stack: Any,
) -> None:
    """No reconcile round in between (60 s): the refusal alone tells the proxy of the pause; the request is held,
    never answered vLLM's 503, and the trainer's /resume (through the proxy, as for any pause) releases it."""
    stack: Stack = await make_stack(reconcile_interval_s=60)
    await stack.sim.pause("abort")  # a trainer's /pause sent straight to vLLM
    request = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1, timeout=3)
    state = await stack.state()
    assert state["state"] == "PAUSED" and state["drift_events"][-1]["cause"] == "engine_paused", state
    assert (await stack.client.post("/resume")).status == 200
    answer = await asyncio.wait_for(request, 10)
    assert answer.status == 200, await answer.text()
    assert stack.sim_count("generate") == 2  # refused once by vLLM, then run


async def test_15_a_stream_vllm_refuses_in_band_because_a_trainer_paused_it_is_held_not_passed_on(
    make_stack: Any,
) -> None:
    """vLLM 0.33 answers a stream 200, then its refusal as the only event: none of it may reach the client."""
    stack: Stack = await make_stack(reconcile_interval_s=60)
    await stack.sim.pause("wait")
    request = asyncio.ensure_future(stack.completion(stream=True))
    await stack.wait_held(1, timeout=3)
    assert (await stack.client.post("/resume")).status == 200
    answer = await asyncio.wait_for(request, 10)
    text = await answer.text()
    assert answer.status == 200 and '"error"' not in text and '"choices"' in text and text.rstrip().endswith("[DONE]")


# ----- 17: a resume after a KV-cache wake (verl #7846: the double resume that deadlocks data-parallel ranks)


async def test_17_a_resume_after_the_kv_cache_wake_never_reaches_vllm(make_stack: Any) -> None:
    """vLLM's wake of the last tag already resumes the scheduler; a trainer's /resume on top of it reached every DP
    rank a second time in verl. Through the proxy it is answered as a no-op, and nothing ran before the wake's
    verification let it (the gate-until-verified pattern of verl's fix)."""
    stack: Stack = await make_stack()
    assert (await stack.client.post("/sleep?level=1")).status == 200
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    assert (await stack.client.post("/wake_up?tags=weights")).status == 200
    assert (await stack.client.post("/wake_up?tags=kv_cache")).status == 200
    resumes = stack.sim_count("resume")
    resume = await stack.client.post("/resume")
    assert (resume.status, resume.headers["X-Lifeguard-Noop"]) == (200, "true")
    assert stack.sim_count("resume") == resumes
    assert (await asyncio.wait_for(held, 10)).status == 200
    assert stack.sim.violations == []
