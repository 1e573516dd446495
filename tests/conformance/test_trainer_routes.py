"""Routes and fields the RL trainers' clients use beyond plain completions (tests/clients drives the
clients themselves): token ids on completions, batched prompts with n>1, `/server_info` as JSON,
`/inference/v1/generate`, and runtime LoRA adapters.

The real engine for this suite runs with `--enable-scale-out`; the LoRA scenarios need an adapter
directory the engine can load (`CONFORMANCE_LORA_PATH`: scripts/test-vllm.sh builds one for the tiny model with
scripts/vllm/make_tiny_lora.py) and a vLLM started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`
(the launcher's `--enable-lora`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.api import VllmApi
from tests.conformance.conftest import REAL_ENGINE_URL
from tests.lifeguard_testing import missing

PROMPT_IDS = [1, 45, 74, 31]


async def test_completion_returns_token_ids_when_asked(vllm: VllmApi) -> None:
    body = {"model": vllm.model, "prompt": PROMPT_IDS, "max_tokens": 5, "return_token_ids": True, "logprobs": 0}
    answer = await vllm.call("POST", "/v1/completions", json_body=body)
    assert answer.status == 200, answer.text
    choice = answer.body["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT_IDS
    assert len(choice["token_ids"]) == 5 and all(isinstance(t, int) for t in choice["token_ids"])
    assert len(choice["logprobs"]["token_logprobs"]) == 5


async def test_completion_has_no_token_ids_unless_asked(vllm: VllmApi) -> None:
    answer = await vllm.completion(max_tokens=2)
    assert answer.status == 200
    assert answer.body["choices"][0].get("token_ids") is None


async def test_tokens_as_token_ids_name_each_token_by_id(vllm: VllmApi) -> None:
    body = {
        "model": vllm.model,
        "prompt": PROMPT_IDS,
        "max_tokens": 3,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    answer = await vllm.call("POST", "/v1/completions", json_body=body)
    assert answer.status == 200, answer.text
    choice = answer.body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


async def test_batched_prompts_with_n_answer_prompt_major(vllm: VllmApi) -> None:
    prompts = [PROMPT_IDS, PROMPT_IDS[:2]]
    body = {"model": vllm.model, "prompt": prompts, "n": 2, "max_tokens": 3, "return_token_ids": True}
    answer = await vllm.call("POST", "/v1/completions", json_body=body)
    assert answer.status == 200, answer.text
    choices = answer.body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert all(len(c["token_ids"]) == 3 for c in choices)
    assert answer.body["usage"]["completion_tokens"] == 12


async def test_server_info_as_json_names_the_dtype_and_weight_transfer(vllm: VllmApi) -> None:
    answer = await vllm.call("GET", "/server_info", params={"config_format": "json"})
    assert answer.status == 200, answer.text
    config = answer.body["vllm_config"]
    assert isinstance(config, dict)
    assert config["model_config"]["dtype"].startswith("torch.")
    assert "weight_transfer_config" in config


async def test_server_info_rejects_an_unknown_format(vllm: VllmApi) -> None:
    answer = await vllm.call("GET", "/server_info", params={"config_format": "yaml"})
    assert answer.status == 400
    assert answer.body["error"]["param"] == "query.config_format" or "config_format" in answer.text


async def test_generate_answers_token_ids_with_logprobs(vllm: VllmApi) -> None:
    body = {"model": vllm.model, "token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 4, "logprobs": 1}}
    answer = await vllm.call("POST", "/inference/v1/generate", json_body=body)
    assert answer.status == 200, answer.text
    choice = answer.body["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    assert all(isinstance(entry["logprob"], float) for entry in content)


async def test_generate_without_sampling_params_is_a_400(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/inference/v1/generate", json_body={"token_ids": PROMPT_IDS})
    assert answer.status in (400, 422), answer.text


async def test_generate_is_a_403_without_scale_out(aiohttp_server: Any, session: Any, sim_only: None) -> None:
    """vLLM 0.32 routes the path without the flag, to a 403 stand-in (entrypoints/scale_out/factories.py).
    Simulator-only here because the real engine of this suite runs with the flag; tests/vllm's
    test_vllm_clients.py checks what SkyRL sees through the proxy with it."""
    from lifeguard_sim.app import SimSettings, create_sim_app

    server = await aiohttp_server(create_sim_app(SimSettings(model="tiny")))
    body = {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 2}}
    async with session.post(server.make_url("/inference/v1/generate"), json=body) as response:
        assert response.status == 403
        error = (await response.json())["error"]
        assert (error["type"], error["code"]) == ("PermissionDeniedError", 403)
        assert "--enable-scale-out" in error["message"]
    async with session.post(server.make_url("/v1/load_lora_adapter"), json={"lora_name": "a"}) as response:
        assert response.status == 404


@pytest.fixture
def lora_path(tmp_path: Path) -> str:
    if REAL_ENGINE_URL:
        path = os.environ.get("CONFORMANCE_LORA_PATH")
        if not path:
            missing("CONFORMANCE_LORA_PATH is not set: the real engine has no LoRA adapter to load")
        return path
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    return str(tmp_path)


async def test_a_loaded_adapter_is_servable_by_name_until_unloaded(vllm: VllmApi, lora_path: str) -> None:
    adapter = {"lora_name": "conf-a", "lora_path": lora_path}
    load = await vllm.call("POST", "/v1/load_lora_adapter", json_body=adapter)
    assert load.status == 200, load.text
    assert "conf-a" in load.text
    try:
        models = await vllm.get("/v1/models")
        assert [card["id"] for card in models.body["data"]] == [vllm.model, "conf-a"]
        body = {"model": "conf-a", "prompt": PROMPT_IDS, "max_tokens": 2}
        answer = await vllm.call("POST", "/v1/completions", json_body=body)
        assert answer.status == 200, answer.text
        assert answer.body["model"] == "conf-a"
        again = await vllm.call("POST", "/v1/load_lora_adapter", json_body=adapter)
        assert again.status == 400 and "already been loaded" in again.body["error"]["message"]
    finally:
        unload = await vllm.call("POST", "/v1/unload_lora_adapter", json_body={"lora_name": "conf-a"})
    assert unload.status == 200, unload.text
    answer = await vllm.call("POST", "/v1/completions", json_body={"model": "conf-a", "prompt": PROMPT_IDS})
    assert answer.status == 404
    gone = await vllm.call("POST", "/v1/unload_lora_adapter", json_body={"lora_name": "conf-a"})
    assert gone.status == 404


async def test_an_adapter_still_listed_after_a_sleep_and_a_wake_answers_as_before(
    vllm: VllmApi, lora_path: str
) -> None:
    """What the LoRA check after a wake relies on (proxy/lifecycle/verifier.py): an adapter listed by /v1/models after a
    level-1 sleep and a wake answers as it did before the sleep (not as the base model). A healthy engine keeps it
    through the cycle, and so must this one: a scenario that accepted the adapter gone would assert nothing at all.
    (The adapter lost in a wake, vLLM #53888, is the simulator's `lose-lora` fault: tests/e2e/test_lies_vllm033.py.)"""
    adapter = {"lora_name": "conf-w", "lora_path": lora_path}
    assert (await vllm.call("POST", "/v1/load_lora_adapter", json_body=adapter)).status == 200

    async def tokens(model: str) -> Any:
        body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        answer = await vllm.call("POST", "/v1/completions", json_body=body)
        assert answer.status == 200, answer.text
        return answer.body["choices"][0]["text"]

    try:
        before = await tokens("conf-w")
        assert before != await tokens(vllm.model)  # the adapter is applied: it does not answer as the base model
        assert (await vllm.sleep(1)).status == 200
        assert (await vllm.wake()).status == 200
        listed = [card["id"] for card in (await vllm.get("/v1/models")).body["data"]]
        assert "conf-w" in listed, listed
        assert await tokens("conf-w") == before
    finally:
        await vllm.call("POST", "/v1/unload_lora_adapter", json_body={"lora_name": "conf-w"})


async def test_loading_an_adapter_from_a_missing_path_fails(vllm: VllmApi, lora_path: str, tmp_path: Path) -> None:
    body = {"lora_name": "conf-missing", "lora_path": str(tmp_path / "no-such-adapter")}
    answer = await vllm.call("POST", "/v1/load_lora_adapter", json_body=body)
    assert answer.status in (400, 404), answer.text
    assert answer.body["error"]["message"]
