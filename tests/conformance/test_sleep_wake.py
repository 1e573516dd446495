"""/sleep, /wake_up and /is_sleeping: bodies, validation, per-tag state, idempotency, metrics."""

from __future__ import annotations

import pytest

from tests.conformance.api import VllmApi
from tests.conformance.conftest import on_profiles

pytestmark = on_profiles("0.32", "0.33", "0.34")


@pytest.mark.parametrize("level", [0, 1, 2])
async def test_sleep_answers_its_level_and_reports_sleeping(vllm: VllmApi, level: int) -> None:
    answer = await vllm.sleep(level)
    assert (answer.status, answer.body) == (200, {"status": "sleeping", "level": level})
    assert await vllm.is_sleeping()
    assert await vllm.is_paused()


@pytest.mark.parametrize(("raw", "message"), [("5", "less than or equal to 2"), ("-1", "greater than or equal to 0")])
async def test_sleep_level_outside_0_to_2_is_400(vllm: VllmApi, raw: str, message: str) -> None:
    answer = await vllm.post("/sleep", level=raw)
    assert answer.status == 400
    assert answer.body["error"]["param"] == "query.level"
    assert message in answer.body["error"]["message"]
    assert not await vllm.is_sleeping()


async def test_sleep_level_that_is_not_an_integer_is_400(vllm: VllmApi) -> None:
    answer = await vllm.post("/sleep", level="deep")
    assert answer.status == 400
    assert answer.body["error"]["param"] == "query.level"


async def test_sleep_with_an_unknown_mode_is_400(vllm: VllmApi) -> None:
    answer = await vllm.post("/sleep", level=1, mode="gently")
    assert answer.status == 400
    assert answer.body["error"]["param"] == "query.mode"
    assert not await vllm.is_sleeping()


async def test_wake_on_an_awake_engine_answers_awake_with_null_tags(vllm: VllmApi) -> None:
    answer = await vllm.wake()
    assert (answer.status, answer.body) == (200, {"status": "awake", "tags": None})


async def test_full_wake_ends_sleep(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    answer = await vllm.wake()
    assert (answer.status, answer.body) == (200, {"status": "awake", "tags": None})
    assert not await vllm.is_sleeping()
    assert not await vllm.is_paused()


@pytest.mark.parametrize("level", [1, 2])
async def test_partial_wake_stays_sleeping_until_every_tag_is_awake(vllm: VllmApi, level: int) -> None:
    await vllm.sleep(level)
    answer = await vllm.wake("weights")
    assert (answer.status, answer.body) == (200, {"status": "sleeping", "tags": ["weights"]})
    assert await vllm.is_sleeping()
    answer = await vllm.wake("kv_cache")
    assert (answer.status, answer.body) == (200, {"status": "awake", "tags": ["kv_cache"]})
    assert not await vllm.is_sleeping()


async def test_level_0_sleep_wakes_with_the_scheduling_tag(vllm: VllmApi) -> None:
    await vllm.sleep(0)
    answer = await vllm.wake("scheduling")
    assert (answer.status, answer.body) == (200, {"status": "awake", "tags": ["scheduling"]})
    assert not await vllm.is_sleeping()


async def test_unknown_tag_is_a_silent_no_op(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    answer = await vllm.wake("bogus")
    assert (answer.status, answer.body) == (200, {"status": "sleeping", "tags": ["bogus"]})
    assert await vllm.is_sleeping()


async def test_comma_joined_tags_are_a_silent_no_op(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    answer = await vllm.post("/wake_up", tags="weights,kv_cache")
    assert (answer.status, answer.body) == (200, {"status": "sleeping", "tags": ["weights,kv_cache"]})
    assert await vllm.is_sleeping()


async def test_repeated_sleep_and_wake_answer_200(vllm: VllmApi) -> None:
    assert (await vllm.sleep(1)).status == 200
    assert (await vllm.sleep(1)).status == 200
    assert await vllm.is_sleeping()
    assert (await vllm.wake()).status == 200
    assert (await vllm.wake()).status == 200
    assert not await vllm.is_sleeping()


async def test_health_stays_200_while_asleep(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    assert (await vllm.get("/health")).status == 200


@pytest.mark.parametrize(("level", "expected"), [(0, (0.0, 0.0, 0.0)), (1, (0.0, 1.0, 0.0)), (2, (0.0, 0.0, 1.0))])
async def test_sleep_state_metric_follows_the_level(
    vllm: VllmApi, level: int, expected: tuple[float, float, float]
) -> None:
    await vllm.sleep(level)
    assert await vllm.sleep_state_metric() == expected
    await vllm.wake()
    assert await vllm.sleep_state_metric() == (1.0, 0.0, 0.0)


async def test_partial_wake_keeps_the_sleep_level_in_the_metric(vllm: VllmApi) -> None:
    # Measured on vLLM 0.32.0: the gauge flips to awake only when every tag is awake (older vLLM
    # recorded awake on any wake call).
    await vllm.sleep(1)
    await vllm.wake("weights")
    assert await vllm.is_sleeping()
    assert await vllm.sleep_state_metric() == (0.0, 1.0, 0.0)


async def test_sleep_and_wake_are_counted_in_the_duration_histogram(vllm: VllmApi) -> None:
    name = "vllm:sleep_mode_operation_duration_seconds_count"
    sleeps = await vllm.metric_sum(name, operation="sleep")
    wakes = await vllm.metric_sum(name, operation="wake")
    await vllm.sleep(1)
    await vllm.wake()
    assert await vllm.metric_sum(name, operation="sleep") == sleeps + 1
    assert await vllm.metric_sum(name, operation="wake") == wakes + 1
