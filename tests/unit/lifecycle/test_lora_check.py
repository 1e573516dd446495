"""The verifier's LoRA check (proxy/lifecycle/verifier.py): adapters served before a sleep must be served, and answer as
before,
after the wake (vLLM #53888: an adapter still listed that answers like the base model). Against a fake vLLM whose
/v1/models and per-model canary answers the test sets; the simulator's `wake_up:lose-lora` drives the same check
end to end in tests/e2e/test_lies.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from proxy.config import Settings
from proxy.gpu.readers import GpuReading
from proxy.lifecycle.verdict import Verdict
from proxy.lifecycle.verifier import AdapterMark, CanaryAnswer, Expectation, Verifier, listed_adapters
from proxy.upstream.observation import Observation
from proxy.upstream.vllm_client import Reply, VllmClient

AWAKE = Observation(reachable=True, healthy=True, sleeping=False, paused=False)
FULL_WAKE = Expectation(sleeping=False, paused=False, canary=True)


def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "root": root, "parent": parent}


@dataclass
class FakeVllm:
    """/v1/models lists `adapters` (name -> root) after the base model `tiny`; each model answers `answers[model]`."""

    adapters: dict[str, str] = field(default_factory=dict)
    answers: dict[str, tuple[str, float]] = field(default_factory=lambda: {"tiny": (" Paris", -0.5)})
    models_status: int = 200
    models_body: bytes | None = None
    completions: list[str] = field(default_factory=list)
    # What a model answers when asked for more than one token (the first token and logprob as in `answers`).
    longer: dict[str, str] = field(default_factory=dict)

    async def observe(self) -> Observation:
        return AWAKE

    async def call(self, method: str, path: str, **kwargs: Any) -> Reply:
        if path == "/v1/models":
            if self.models_body is not None or self.models_status != 200:
                return Reply(self.models_status, self.models_body or b'{"detail":"boom"}', "application/json")
            cards = [card("tiny", "/models/tiny", None), *(card(n, r, "tiny") for n, r in self.adapters.items())]
            return Reply(200, json.dumps({"object": "list", "data": cards}).encode(), "application/json")
        model = kwargs["json_body"]["model"]
        self.completions.append(model)
        text, logprob = self.answers[model] if model in self.adapters or model == "tiny" else (" ?", -9.0)
        if kwargs["json_body"]["max_tokens"] > 1:
            text = self.longer[model]
        body = {"choices": [{"text": text, "logprobs": {"token_logprobs": [logprob]}}]}
        return Reply(200, json.dumps(body).encode(), "application/json")


class NoGpu:
    async def read(self) -> GpuReading:
        return GpuReading(unavailable="no GPU here")


def verifier(vllm: FakeVllm, **overrides: Any) -> Verifier:
    settings = Settings(upstream="http://127.0.0.1:9", verify_timeout_s=0.2, verify_poll_interval_s=0.01, **overrides)
    return Verifier(cast(VllmClient, vllm), NoGpu(), settings)


def lora(verdict: Verdict) -> tuple[str, str] | None:
    check = next((c for c in verdict.checks if c.name == "lora"), None)
    return None if check is None else (check.result.value, check.detail)


async def slept_with(vllm: FakeVllm, **overrides: Any) -> Verifier:
    """A verifier that recorded the engine while healthy (a reconcile round) and saw a sleep begin."""
    v = verifier(vllm, **overrides)
    await v.record_golden()
    await v.record_adapters()
    v.adapters_before_sleep()
    return v


def test_the_adapters_are_the_cards_with_a_parent() -> None:
    body = {"data": [card("tiny", "tiny", None), card("sql", "/lora/sql", "tiny"), card("b", "/lora/b", "other")]}
    assert listed_adapters(body) == {"sql": "/lora/sql", "b": "/lora/b"}


@pytest.mark.parametrize("body", [[], {"object": "list"}, {"data": "x"}, {"data": [{"object": "model"}]}, None])
def test_a_models_body_that_is_not_a_model_list_says_why(body: Any) -> None:
    with pytest.raises(ValueError):
        listed_adapters(body)


async def test_each_adapter_is_recorded_with_its_own_canary_answer() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = verifier(vllm)
    await v.record_adapters()
    assert v.adapters == {"sql": AdapterMark("/lora/sql", CanaryAnswer(" SELECT", -0.2))}
    await v.record_adapters()
    assert vllm.completions == ["sql"]  # recorded once, not in every round


async def test_an_adapter_that_answers_as_before_passes() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    verdict = await v.verify(FULL_WAKE, memory_before=None)
    assert verdict.failed is None
    assert lora(verdict) == ("pass", "1 adapter(s) listed as before the sleep, 1 answering as before")


async def test_an_adapter_that_answers_like_the_base_model_after_the_wake_fails_naming_it() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    vllm.answers["sql"] = vllm.answers["tiny"]  # vLLM #53888: still listed, answers like the base model
    verdict = await v.verify(FULL_WAKE, memory_before=None)
    result = lora(verdict)
    assert result is not None and result[0] == "fail"
    assert "adapter 'sql' answers ' Paris' (-0.500) as the base model does" in result[1]
    assert "before the sleep it answered ' SELECT'" in result[1]
    assert verdict.failed is not None and verdict.failed.value == ["sql"]


async def test_an_adapter_whose_first_token_is_the_base_models_is_checked_by_a_longer_answer() -> None:
    """A one-token canary cannot tell such an adapter from the base model it turns into when a wake loses it (the
    check matrix's lora-across-wake row let a lost adapter through once in CI, by a first-token collision)."""
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" Paris", -0.5)},
                    longer={"tiny": " Paris is the capital", "sql": " Paris SELECT * FROM"})  # fmt: skip
    v = await slept_with(vllm)
    vllm.answers["sql"], vllm.longer["sql"] = vllm.answers["tiny"], vllm.longer["tiny"]  # lost in the wake
    result = lora(await v.verify(FULL_WAKE, memory_before=None))
    assert result is not None and result[0] == "fail"
    assert "adapter 'sql' answers ' Paris is the capital' (-0.500)" in result[1]
    assert "before the sleep it answered ' Paris SELECT * FROM'" in result[1]


async def test_an_adapter_no_longer_listed_fails_naming_it() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql", "chat": "/lora/chat"},
                    answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2), "chat": (" Hi", -0.1)})  # fmt: skip
    v = await slept_with(vllm)
    del vllm.adapters["chat"]
    result = lora(await v.verify(FULL_WAKE, memory_before=None))
    assert result is not None and result[0] == "fail"
    assert "adapter 'chat' (loaded from /lora/chat) is no longer listed by /v1/models" in result[1]
    assert "'sql'" not in result[1]


@pytest.mark.parametrize(("status", "body"), [(500, b'{"detail":"boom"}'), (200, b"not json"), (200, b'{"x":1}')])
async def test_a_models_list_that_cannot_be_read_after_the_wake_is_a_failure_not_a_pass(
    status: int, body: bytes
) -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    vllm.models_status, vllm.models_body = status, body
    result = lora(await v.verify(FULL_WAKE, memory_before=None))
    assert result is not None and result[0] == "fail"
    assert result[1].startswith("/v1/models could not be read after the wake:")


async def test_without_adapters_before_the_sleep_there_is_no_lora_check() -> None:
    v = await slept_with(FakeVllm())
    assert lora(await v.verify(FULL_WAKE, memory_before=None)) is None


async def test_a_lora_load_through_the_proxy_between_sleep_and_wake_is_not_a_loss() -> None:
    """SkyRL loads its adapter between wake_up?tags=weights and tags=kv_cache: new adapter weights, on purpose."""
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    v.forget_adapters()  # what the coordinator does after a serialized control call
    vllm.answers["sql"] = (" UPDATE", -0.3)
    assert lora(await v.verify(FULL_WAKE, memory_before=None)) is None


async def test_adapters_past_the_canary_limit_are_only_checked_to_be_listed() -> None:
    vllm = FakeVllm(adapters={"a": "/l/a", "b": "/l/b"},
                    answers={"tiny": (" Paris", -0.5), "a": (" A", -0.1), "b": (" B", -0.1)})  # fmt: skip
    v = await slept_with(vllm, lora_canary_max_adapters=1)
    assert sum(1 for mark in v.adapters.values() if mark.golden is not None) == 1
    result = lora(await v.verify(FULL_WAKE, memory_before=None))
    assert result == ("pass", "2 adapter(s) listed as before the sleep, 1 answering as before")


async def test_lora_check_off_records_nothing() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm, lora_check=False)
    assert v.adapters == {} and lora(await v.verify(FULL_WAKE, memory_before=None)) is None


async def test_the_failure_heals_once_the_adapter_answers_as_before_or_is_unloaded_or_reloaded() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    vllm.answers["sql"] = vllm.answers["tiny"]
    assert (await v.verify(FULL_WAKE, memory_before=None)).failed is not None
    still = await v.recheck_adapters()
    assert still.result.value == "fail" and "'sql'" in still.detail
    vllm.answers["sql"] = (" SELECT", -0.25)  # loaded again behind the proxy's back, from the same path
    assert (await v.recheck_adapters()).result.value == "pass"
    assert v.lost_adapters == {}


async def test_a_reload_through_the_proxy_heals_even_with_new_adapter_weights() -> None:
    vllm = FakeVllm(adapters={"sql": "/lora/sql"}, answers={"tiny": (" Paris", -0.5), "sql": (" SELECT", -0.2)})
    v = await slept_with(vllm)
    vllm.answers["sql"] = vllm.answers["tiny"]
    await v.verify(FULL_WAKE, memory_before=None)
    v.forget_adapters()
    vllm.answers["sql"] = (" INSERT", -0.4)  # a trainer's new adapter version at the same path
    assert (await v.recheck_adapters()).result.value == "pass"
