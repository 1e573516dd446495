"""Weight version, reload and weight-update ordering.

Real vLLM on CPU has no weight transfer configured (every weight-update call is 500) and frees nothing on
sleep, so the ordering and level-2 scenarios are simulator-only.
"""

from __future__ import annotations

import pytest

from tests.conformance.api import VllmApi
from tests.conformance.conftest import on_profiles

pytestmark = on_profiles("0.32", "0.33", "0.34")


async def test_update_weight_version_is_reported_by_weight_info(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/update_weight_version", json_body={"new_version": "v2"})
    assert (answer.status, answer.body) == (200, {"success": True, "new_version": "v2"})
    assert (await vllm.get("/weight_info")).body == {"weight_version": "v2"}


async def test_weight_info_starts_at_default(vllm: VllmApi, sim_only: None) -> None:
    assert (await vllm.get("/weight_info")).body == {"weight_version": "default"}


async def _golden(vllm: VllmApi) -> str:
    answer = await vllm.completion(prompt="Paris is the capital of", max_tokens=8, ignore_eos=True)
    return str(answer.body["choices"][0]["text"])


async def test_level_2_woken_without_reload_produces_garbage(vllm: VllmApi, sim_only: None) -> None:
    golden = await _golden(vllm)
    await vllm.sleep(2)
    await vllm.wake()
    assert await _golden(vllm) != golden


async def test_level_2_with_reload_weights_restores_golden_output(vllm: VllmApi, sim_only: None) -> None:
    golden = await _golden(vllm)
    await vllm.sleep(2)
    await vllm.wake("weights")
    answer = await vllm.call("POST", "/collective_rpc", json_body={"method": "reload_weights"})
    assert (answer.status, answer.text) == (200, "")
    await vllm.wake("kv_cache")
    assert await _golden(vllm) == golden


async def test_collective_rpc_needs_a_method(vllm: VllmApi, sim_only: None) -> None:
    answer = await vllm.call("POST", "/collective_rpc", json_body={})
    assert answer.status == 400


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weights", {"update_info": {}}, "start_weight_update must be called before update_weights."),
        ("/finish_weight_update", {}, "finish_weight_update called without a matching start_weight_update."),
    ],
)
async def test_weight_update_out_of_order_is_500(
    vllm: VllmApi, sim_only: None, path: str, body: dict[str, object], message: str
) -> None:
    answer = await vllm.call("POST", path, json_body=body)
    assert answer.status == 500
    assert message in answer.body["error"]["message"]
    assert answer.body["error"]["type"] == "InternalServerError"


async def test_start_weight_update_twice_is_500(vllm: VllmApi, sim_only: None) -> None:
    assert (await vllm.post("/start_weight_update")).status == 200
    answer = await vllm.post("/start_weight_update")
    assert answer.status == 500
    assert "Call finish_weight_update first." in answer.body["error"]["message"]


async def test_weight_update_sequence_sets_the_version(vllm: VllmApi, sim_only: None) -> None:
    init = await vllm.call("POST", "/init_weight_transfer_engine", json_body={"init_info": {}})
    assert (init.status, init.body) == (200, {"message": "Weight transfer initialized"})
    assert (await vllm.post("/start_weight_update")).body == {"message": "Weight update started"}
    update = await vllm.call("POST", "/update_weights", json_body={"update_info": {}})
    assert (update.status, update.body) == (200, {"message": "Weights updated"})
    finish = await vllm.call("POST", "/finish_weight_update", json_body={"weight_version": "step-7"})
    assert (finish.status, finish.body) == (200, {"message": "Weight update finished"})
    assert (await vllm.get("/weight_info")).body == {"weight_version": "step-7"}


@pytest.mark.parametrize(
    ("path", "key"), [("/init_weight_transfer_engine", "init_info"), ("/update_weights", "update_info")]
)
async def test_weight_calls_without_their_payload_are_400(vllm: VllmApi, sim_only: None, path: str, key: str) -> None:
    answer = await vllm.call("POST", path, json_body={})
    assert answer.status == 400
    assert key in answer.body["error"]["message"]


async def test_sim_state_reports_the_true_state(vllm: VllmApi, sim_only: None) -> None:
    await vllm.sleep(2)
    await vllm.wake("weights")
    state = (await vllm.get("/sim/state")).body
    assert state["asleep_tags"] == ["kv_cache"]
    assert state["sleep_level"] == 2
    assert state["weights_valid"] is False
    assert state["counters"]["sleep"] == 1
    assert state["violations"] == []
