"""AReaL 1.0.4's own HTTP path through the proxy: `areal.infra.utils.http.arequest_with_retry` sending
the requests `areal.engine.vllm_remote.VLLMBackend` builds, in the order AReaL makes them:

* a rollout (`RemoteInfEngine.agenerate`: `build_generation_request`, then `parse_generation_response`);
* the colocated offload (`RLTrainer._offload_rollout`: `pause_generation` = `/areal_pause_generation`,
  `offload` = `/sleep`), training for a few seconds, then `_onload_rollout` (`onload` = `/wake_up`,
  `continue_generation`);
* the disk weight update (`FSDPEngine._update_weights_from_disk`: `pause_generation`, the checkpoint
  written for a few seconds, `build_disk_weight_update_requests` = `/areal_update_weights`, then
  `continue_generation`).

`VLLMBackend` and the request types are compiled from AReaL's installed source (their modules import
torch and Ray at the top). The simulator serves AReaL's server-wrapper routes (trainer_servers=areal).
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.clients.conftest import Stack
from tests.clients.stand_ins import bare_packages, client_site, definitions, load

# AReaL's defaults (areal/api/cli_args.py InferenceEngineConfig): 3 attempts, 1 s apart.
RETRIES = 3


@dataclass
class Areal:
    request: Callable[..., Awaitable[Any]]  # arequest_with_retry
    backend: Any  # a VLLMBackend
    addr: str

    async def send(self, http_request: Any) -> Any:
        return await self.request(
            addr=self.addr,
            endpoint=http_request.endpoint,
            payload=http_request.payload,
            method=http_request.method,
            max_retries=RETRIES,
            timeout=30,
        )

    async def rollout(self, version: int = 0) -> Any:
        gconfig = types.SimpleNamespace(
            stop_token_ids=[], top_p=1.0, top_k=-1, max_new_tokens=6, greedy=False, temperature=1.0,
            ignore_eos=True, skip_special_tokens=True, use_beam_search=False, lora_name=None,
        )  # fmt: skip
        model_request = types.SimpleNamespace(gconfig=gconfig, input_ids=[1, 45, 74], vision_msg_vllm=None)
        http_request = self.backend.build_generation_request(model_request, with_lora=False, version=version)
        result = self.backend.parse_generation_response(await self.send(http_request))
        assert result.stop_reason == "length" and len(result.output_tokens) == 6, result
        return result


@pytest.fixture
def areal(make_stack: Callable[..., Awaitable[Stack]]) -> Callable[[], Awaitable[tuple[Stack, Areal]]]:
    site = client_site()
    http = load(bare_packages(site, "areal.infra.utils"), "areal.infra.utils.http")
    namespace: dict[str, Any] = {"dataclass": dataclass, "field": field, "Any": Any}
    definitions(
        site / "areal/api/io_struct.py", {"HttpRequest", "HttpGenerationResult", "WeightUpdateRequests"}, namespace
    )
    definitions(site / "areal/api/io_struct.py", {"get_versioned_lora_name", "detect_image_mime"}, namespace)
    definitions(site / "areal/engine/vllm_remote.py", {"VLLMBackend"}, namespace)

    async def make() -> tuple[Stack, Areal]:
        stack = await make_stack(sim={"trainer_servers": ("areal",)}, hold_timeout_s=2.0)
        addr = stack.url.removeprefix("http://")
        return stack, Areal(http.arequest_with_retry, namespace["VLLMBackend"](), addr)

    return make


async def test_rollout_then_colocated_offload_and_onload(areal: Callable[[], Awaitable[tuple[Stack, Areal]]]) -> None:
    stack, client = await areal()
    await client.rollout()
    await client.send(client.backend.get_pause_request())
    await client.send(client.backend.get_offload_request())
    await stack.reconciled()  # the trainer trains; a reconcile round sees the engine asleep meanwhile
    await client.send(client.backend.get_onload_request())
    answer = await client.send(client.backend.get_resume_request())
    assert answer["success"] is True, answer
    await client.rollout()
    assert stack.sent("/areal_pause_generation", "/sleep", "/wake_up", "/areal_continue_generation") == [
        "POST /areal_pause_generation",
        "POST /sleep",
        "POST /wake_up",
        "POST /areal_continue_generation",
    ]
    await stack.assert_clean()


async def test_disk_weight_update(areal: Callable[[], Awaitable[tuple[Stack, Areal]]], tmp_path: Any) -> None:
    stack, client = await areal()
    before = await client.rollout()
    await client.send(client.backend.get_pause_request())
    await stack.reconciled()  # FSDPEngine._save_model_to_hf writes the checkpoint; a round sees the pause
    meta = types.SimpleNamespace(use_lora=False, path=tmp_path / "checkpoint", version=1, lora_name=None)
    (update,) = client.backend.build_disk_weight_update_requests(meta).requests
    assert update.endpoint == "/areal_update_weights"
    answer = await client.send(update)
    assert answer["success"] is True, answer
    await client.send(client.backend.get_resume_request())
    after = await client.rollout(version=1)
    assert after.output_tokens != before.output_tokens, "the new checkpoint was not in use"
    await stack.assert_clean()
