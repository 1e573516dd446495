"""Always-on endpoints: status codes and body shapes as vLLM 0.32 answers them."""

from __future__ import annotations

import pytest

from tests.conformance.api import VllmApi
from tests.conformance.conftest import on_profiles

pytestmark = on_profiles("0.32", "0.33", "0.34")


async def test_health_is_200_with_an_empty_body(vllm: VllmApi) -> None:
    answer = await vllm.get("/health")
    assert (answer.status, answer.text) == (200, "")


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_ping_answers_like_health(vllm: VllmApi, method: str) -> None:
    assert (await vllm.call(method, "/ping")).status == 200


async def test_version_is_reported(vllm: VllmApi, vllm_version: str) -> None:
    answer = await vllm.get("/version")
    assert answer.status == 200
    assert answer.body["version"].startswith(vllm_version + ".")
    assert vllm_version in ("0.32", "0.33", "0.34")


async def test_models_lists_the_served_model(vllm: VllmApi) -> None:
    answer = await vllm.get("/v1/models")
    assert answer.status == 200
    assert answer.body["object"] == "list"
    assert [card["id"] for card in answer.body["data"]] == [vllm.model]
    assert answer.body["data"][0]["max_model_len"] > 0


async def test_unknown_path_is_fastapi_404(vllm: VllmApi) -> None:
    answer = await vllm.get("/no/such/path")
    assert (answer.status, answer.body) == (404, {"detail": "Not Found"})


async def test_load_starts_at_zero(vllm: VllmApi) -> None:
    answer = await vllm.get("/load")
    assert (answer.status, answer.body) == (200, {"server_load": 0})


async def test_tokenize_counts_tokens(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/tokenize", json_body={"prompt": "hello"})
    assert answer.status == 200
    assert answer.body["count"] == len(answer.body["tokens"]) > 0
    assert answer.body["max_model_len"] > 0


async def test_detokenize_inverts_tokenize(vllm: VllmApi) -> None:
    tokens = (await vllm.call("POST", "/tokenize", json_body={"prompt": "hello world"})).body["tokens"]
    answer = await vllm.call("POST", "/detokenize", json_body={"tokens": tokens})
    assert answer.status == 200
    assert answer.body["prompt"].endswith("hello world")  # a real tokenizer may prepend BOS


async def test_openapi_lists_the_lifecycle_paths(vllm: VllmApi) -> None:
    answer = await vllm.get("/openapi.json")
    assert answer.status == 200
    paths = set(answer.body["paths"])
    assert {"/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused"} <= paths
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= paths


async def test_metrics_expose_the_lifecycle_series(vllm: VllmApi) -> None:
    answer = await vllm.get("/metrics")
    assert answer.status == 200
    for name in (
        "vllm:engine_sleep_state",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
    ):
        assert name in answer.text
    assert await vllm.sleep_state_metric() == (1.0, 0.0, 0.0)


async def test_get_world_size_is_one(vllm: VllmApi) -> None:
    answer = await vllm.get("/get_world_size")
    assert (answer.status, answer.body) == (200, {"world_size": 1})


async def test_server_info_carries_the_config(vllm: VllmApi) -> None:
    answer = await vllm.get("/server_info")
    assert answer.status == 200
    assert "vllm_config" in answer.body


async def test_reset_prefix_cache_succeeds_when_idle(vllm: VllmApi) -> None:
    answer = await vllm.post("/reset_prefix_cache")
    assert (answer.status, answer.body) == (200, {"success": True})


async def test_the_checkpoint_routes_are_new_in_034(vllm: VllmApi, vllm_version: str) -> None:
    """serve/checkpoint/api_router.py, attached with sleep mode from 0.34 on (launchers/api_server/routers.py)."""
    answer = await vllm.get("/checkpoint/status")
    if vllm_version in ("0.32", "0.33"):
        assert (answer.status, answer.body) == (404, {"detail": "Not Found"})
    else:
        assert (answer.status, answer.body) == (503, {"state": "running"})
