"""`Verifier`: the flags, memory and canary checks, against a fake vLLM client and a scripted GPU reader."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from proxy.config import Settings
from proxy.errors import UpstreamUnreachable
from proxy.gpu.footprint import Footprint
from proxy.gpu.readers import DeviceMemory, GpuReading
from proxy.lifecycle.verdict import Verdict
from proxy.lifecycle.verifier import Expectation, MemoryChange, Verifier
from proxy.upstream.observation import Observation
from proxy.upstream.vllm_client import Reply, VllmClient

GIB = 1 << 30
AWAKE = Observation(reachable=True, healthy=True, sleeping=False, paused=False)
ASLEEP = Observation(reachable=True, healthy=True, sleeping=True, paused=True)


def used(gib: float) -> GpuReading:
    return GpuReading(devices=(DeviceMemory("0", int(gib * GIB), 80 * GIB),))


UNAVAILABLE = GpuReading(unavailable="NVML: NVML Shared Library Not Found")


@dataclass
class FakeClient:
    """Observations in order (the last one repeats) and canary answers (text, logprob) or a status."""

    observations: list[Observation] = field(default_factory=lambda: [AWAKE])
    answers: list[tuple[str, float | None] | int | Exception] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    observed: int = 0

    async def observe(self) -> Observation:
        self.observed += 1
        return self.observations.pop(0) if len(self.observations) > 1 else self.observations[0]

    async def call(self, method: str, path: str, **kwargs: Any) -> Reply:
        self.calls.append((method, path))
        if path == "/v1/models":
            return _json_reply({"object": "list", "data": [{"id": "tiny"}]})
        assert path == "/v1/completions" and kwargs["json_body"]["model"] == "tiny"
        assert kwargs["json_body"]["max_tokens"] == 1 and kwargs["json_body"]["logprobs"] == 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, int):
            return _json_reply({"error": {"message": "boom"}}, status=answer)
        text, logprob = answer
        return _json_reply({"choices": [{"text": text, "logprobs": {"token_logprobs": [logprob]}}]})


def _json_reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(body).encode(), "application/json")


@dataclass
class ScriptedGpu:
    """Readings in order; the last one repeats."""

    readings: list[GpuReading]
    reads: int = 0

    async def read(self) -> GpuReading:
        self.reads += 1
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "upstream": "http://127.0.0.1:9",
        "verify_timeout_s": 0.2,
        "verify_poll_interval_s": 0.01,
        **overrides,
    }
    return Settings(**values)


def verifier(
    client: FakeClient | None = None, readings: Iterable[GpuReading] = (UNAVAILABLE,), **overrides: Any
) -> tuple[Verifier, FakeClient, ScriptedGpu]:
    fake = client or FakeClient()
    gpu = ScriptedGpu(list(readings))
    checks: list[tuple[str, str]] = []
    v = Verifier(cast(VllmClient, fake), gpu, settings(**overrides), on_check=lambda n, r: checks.append((n, r)))
    return v, fake, gpu


def results(verdict: Verdict) -> dict[str, str]:
    return {c.name: c.result for c in verdict.checks}


# ----- flags and health
async def test_flags_that_agree_pass() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]))

    verdict = await v.verify(Expectation(sleeping=True, paused=True), memory_before=None)

    assert results(verdict) == {"health": "pass", "flags": "pass"}
    assert verdict.failed is None and verdict.observation == ASLEEP


async def test_flags_are_polled_until_they_agree() -> None:
    v, client, _ = verifier(FakeClient([AWAKE, AWAKE, ASLEEP]))

    verdict = await v.verify(Expectation(sleeping=True, paused=True), memory_before=None)

    assert verdict.failed is None and client.observed == 3


async def test_flags_that_never_agree_fail_at_the_deadline_with_what_was_seen() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]))
    started = time.monotonic()

    verdict = await v.verify(Expectation(sleeping=False, paused=False), memory_before=None)

    assert time.monotonic() - started >= 0.2
    failed = verdict.failed
    assert failed is not None and failed.name == "flags"
    assert failed.detail == "/is_sleeping is true, expected false"
    assert failed.value == {"is_sleeping": True, "is_paused": True}


async def test_is_paused_disagreeing_fails_even_when_is_sleeping_agrees() -> None:
    v, _, _ = verifier(FakeClient([Observation(reachable=True, healthy=True, sleeping=True, paused=False)]))

    verdict = await v.verify(Expectation(sleeping=True, paused=True), memory_before=None)

    assert verdict.failed is not None and verdict.failed.detail == "/is_paused is false, expected true"


async def test_an_unreachable_engine_fails_health_at_once() -> None:
    v, client, _ = verifier(FakeClient([Observation(reachable=False, error="connection refused")]), verify_timeout_s=60)

    async with asyncio.timeout(10):  # polling until verify_timeout_s would run past this
        verdict = await v.verify(Expectation(sleeping=True), memory_before=None)

    assert client.observed == 1
    assert results(verdict) == {"health": "fail"}
    assert verdict.failed is not None and verdict.failed.detail == "engine unreachable: connection refused"


async def test_health_503_fails_at_once_because_vllm_never_recovers_from_engine_death() -> None:
    v, client, _ = verifier(FakeClient([Observation(reachable=True, healthy=False)]), verify_timeout_s=60)

    async with asyncio.timeout(10):  # polling until verify_timeout_s would run past this
        verdict = await v.verify(Expectation(sleeping=True), memory_before=None)

    assert client.observed == 1
    assert verdict.failed is not None and verdict.failed.detail == "/health is not 200"


# ----- memory
async def test_sleep_that_freed_enough_of_the_awake_footprint_passes() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [used(24)])
    v.note_awake(used(50))

    verdict = await v.verify(Expectation(sleeping=True, paused=True, memory=MemoryChange.FREED), memory_before=used(50))

    assert results(verdict)["memory"] == "pass"
    assert verdict.checks[-1].value == 24 * GIB and verdict.memory == used(24)


async def test_sleep_that_freed_exactly_the_minimum_fraction_passes() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [used(25)])
    v.note_awake(used(50))

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=None)

    assert results(verdict)["memory"] == "pass"


async def test_sleep_that_freed_too_little_fails_and_names_sleep_mode() -> None:
    v, _, gpu = verifier(FakeClient([ASLEEP]), [used(30)])
    v.note_awake(used(50))

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=used(50))

    failed = verdict.failed
    assert failed is not None and failed.name == "memory"
    assert "sleep freed 20.00 GiB of the awake 50.00 GiB" in failed.detail
    assert "--enable-sleep-mode" in failed.detail
    assert gpu.reads > 1  # polled until the deadline: unmapping may lag the 200


async def test_memory_freed_late_passes_within_the_deadline() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [used(50), used(50), used(4)])
    v.note_awake(used(50))

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=used(50))

    assert results(verdict)["memory"] == "pass"


async def test_sleep_without_a_recorded_footprint_uses_the_reading_before() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [used(49)])

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=used(50))

    assert verdict.failed is not None and "of the awake 50.00 GiB" in verdict.failed.detail


async def test_memory_with_no_footprint_at_all_is_unavailable_not_failed() -> None:
    v, _, _ = verifier(FakeClient([AWAKE]), [used(50)])

    verdict = await v.verify(Expectation(sleeping=False, memory=MemoryChange.RESTORED), memory_before=None)

    assert results(verdict)["memory"] == "unavailable" and verdict.failed is None


async def test_wake_that_restored_enough_passes_and_too_little_fails() -> None:
    good, _, _ = verifier(FakeClient([AWAKE]), [used(45)])
    good.note_awake(used(50))
    bad, _, _ = verifier(FakeClient([AWAKE]), [used(44)])
    bad.note_awake(used(50))

    passed = await good.verify(Expectation(sleeping=False, memory=MemoryChange.RESTORED), memory_before=used(4))
    failed = await bad.verify(Expectation(sleeping=False, memory=MemoryChange.RESTORED), memory_before=used(4))

    assert results(passed)["memory"] == "pass"
    assert failed.failed is not None
    assert failed.failed.detail == "wake restored only 44.00 GiB of the awake 50.00 GiB; at least 90% expected"


async def test_a_partial_wake_must_add_memory_back() -> None:
    grew, _, _ = verifier(FakeClient([ASLEEP]), [used(7)])
    grew.note_awake(used(50))  # 5% of 50 GiB = 2.5 GiB
    flat, _, _ = verifier(FakeClient([ASLEEP]), [used(6)])
    flat.note_awake(used(50))

    passed = await grew.verify(Expectation(sleeping=True, memory=MemoryChange.PART_RESTORED), memory_before=used(4))
    failed = await flat.verify(Expectation(sleeping=True, memory=MemoryChange.PART_RESTORED), memory_before=used(4))

    assert results(passed)["memory"] == "pass"
    assert failed.failed is not None and "did not come back" in failed.failed.detail


async def test_before_the_engine_was_seen_awake_its_configured_footprint_is_the_scale() -> None:
    """Found by `make chaos-pods`: a proxy restarted beside a sleeping engine had no awake reading, so the memory
    check of a partial wake was "unknown" and a `lie-asleep` wake of the weights passed (then /update_weights
    reached an engine whose weights slept). Its footprint_gib is the scale until it is seen awake."""
    configured = {"footprint": Footprint(50.0)}
    flat, _, _ = verifier(FakeClient([ASLEEP]), [used(2)])
    flat.footprint = configured["footprint"]
    failed = await flat.verify(Expectation(sleeping=True, memory=MemoryChange.PART_RESTORED), memory_before=used(2))
    assert failed.failed is not None and "did not come back" in failed.failed.detail
    unknown, _, _ = verifier(FakeClient([ASLEEP]), [used(2)])  # no footprint at all: cannot say
    verdict = await unknown.verify(Expectation(sleeping=True, memory=MemoryChange.PART_RESTORED), memory_before=used(2))
    assert results(verdict)["memory"] == "unavailable" and verdict.failed is None


async def test_weights_only_wake_without_a_reading_before_is_unavailable_not_failed() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [used(20)])
    v.note_awake(used(50))

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.PART_RESTORED), memory_before=UNAVAILABLE)

    assert results(verdict)["memory"] == "unavailable" and verdict.failed is None


async def test_no_gpu_makes_the_memory_check_unavailable_and_the_verdict_pass() -> None:
    v, _, _ = verifier(FakeClient([ASLEEP]), [UNAVAILABLE])

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=UNAVAILABLE)

    memory = verdict.checks[-1]
    assert (memory.name, memory.result, memory.detail) == ("memory", "unavailable", UNAVAILABLE.unavailable)
    assert verdict.failed is None and verdict.as_dict()["passed"] is True


async def test_memory_is_not_checked_when_the_flags_failed() -> None:
    v, _, gpu = verifier(FakeClient([AWAKE]), [used(50)])

    verdict = await v.verify(Expectation(sleeping=True, memory=MemoryChange.FREED), memory_before=used(50))

    assert "memory" not in results(verdict) and gpu.reads == 0


def test_note_awake_ignores_unavailable_and_empty_readings() -> None:
    v, _, _ = verifier()
    v.note_awake(UNAVAILABLE)
    v.note_awake(GpuReading())
    assert v.footprint.awake_reading is None
    v.note_awake(used(50))
    assert v.footprint.awake_reading == 50 * GIB


# ----- canary
WAKE = Expectation(sleeping=False, paused=False, canary=True)


async def test_the_first_good_canary_becomes_golden_and_a_match_passes() -> None:
    v, client, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", -0.3), (" Paris", -0.5)]))

    first = await v.verify(WAKE, memory_before=None)
    second = await v.verify(WAKE, memory_before=None)

    assert first.checks[-1].detail == "recorded as golden"
    assert results(second)["canary"] == "pass"
    assert client.calls.count(("GET", "/v1/models")) == 1  # the model name is asked once


async def test_a_different_token_than_golden_fails_as_drift() -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", -0.3), (" river", -0.3)]))
    await v.verify(WAKE, memory_before=None)

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is not None and verdict.failed.name == "canary"
    assert "drifted from golden ' Paris'" in verdict.failed.detail


async def test_a_logprob_beyond_the_tolerance_fails_as_drift() -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", -0.3), (" Paris", -2.4)]), canary_max_logprob_drift=2.0)
    await v.verify(WAKE, memory_before=None)

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is not None and "drifted" in verdict.failed.detail


@pytest.mark.parametrize("logprob", [math.nan, math.inf, -math.inf, None])
async def test_a_non_finite_or_missing_logprob_fails(logprob: float | None) -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", logprob)]))

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is not None and "non-finite logprob" in verdict.failed.detail
    assert v.golden is None  # garbage is never recorded as golden


async def test_a_degenerate_token_fails_even_before_a_golden_exists() -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[("!", -0.1)]))

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is not None and "degenerate token '!'" in verdict.failed.detail


@pytest.mark.parametrize("answer", [500, UpstreamUnreachable("vLLM could not be reached")], ids=["500", "unreachable"])
async def test_a_canary_that_cannot_complete_fails(answer: int | Exception) -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[answer]))

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is not None and verdict.failed.detail.startswith("canary completion failed")


async def test_forget_golden_lets_new_weights_set_a_new_answer() -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", -0.3), (" Lyon", -1.0)]))
    await v.verify(WAKE, memory_before=None)
    v.forget_golden()

    verdict = await v.verify(WAKE, memory_before=None)

    assert verdict.failed is None and v.golden is not None and v.golden.text == " Lyon"


async def test_the_canary_is_skipped_when_disabled_or_when_the_flags_failed() -> None:
    off, off_client, _ = verifier(FakeClient([AWAKE]), canary_enabled=False)
    asleep, asleep_client, _ = verifier(FakeClient([ASLEEP]))

    assert "canary" not in results(await off.verify(WAKE, memory_before=None))
    assert "canary" not in results(await asleep.verify(WAKE, memory_before=None))
    assert off_client.calls == [] and asleep_client.calls == []


async def test_a_failed_canary_verdict_is_strict_json_for_lifeguard_state() -> None:
    v, _, _ = verifier(FakeClient([AWAKE], answers=[(" Paris", math.nan)]))

    verdict = await v.verify(WAKE, memory_before=None)

    text = json.dumps(verdict.as_dict(), allow_nan=False)  # NaN is not JSON: other clients cannot parse it
    assert json.loads(text)["passed"] is False
    assert v.last is verdict
