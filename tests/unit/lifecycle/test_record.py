"""EngineRecord, sans-IO: what one reconcile observation means for the state."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.lifecycle.parsed_calls import parse_call
from proxy.lifecycle.record import EngineRecord, FailureKind
from proxy.lifecycle.rules import Admission, Refuse, admission, control_refusal, judge, unavailable
from proxy.lifecycle.states import State
from proxy.observe.logs import TextFormatter
from proxy.observe.metrics import Metrics
from proxy.upstream.elastic_ep import ElasticStatus
from proxy.upstream.observation import Observation

AWAKE = Observation(reachable=True, healthy=True, sleeping=False, paused=False)
REFUSED = Observation(reachable=False, error="connection refused")


def running_record() -> EngineRecord:
    metrics = Metrics(
        CollectorRegistry(), version="x", engines=["default"], states=[s.value for s in State], operations=["sleep"]
    ).engine("default")
    record = EngineRecord(metrics, lambda: None)
    record.reconcile_with(AWAKE)
    assert record.state is State.RUNNING
    return record


def test_a_refused_connection_fails_the_engine_at_once() -> None:
    record = running_record()
    record.reconcile_with(REFUSED)
    assert record.state is State.FAILED


PAUSED_FLAGS = Observation(reachable=True, healthy=True, sleeping=True, paused=True, metric_awake=True)


def discarded_record() -> EngineRecord:
    record = running_record()
    record.fell_asleep(2)
    record.settle(State.SLEEPING)
    assert record.weights_stale is not None
    return record


def test_a_drafter_session_does_not_bring_back_discarded_weights() -> None:
    record = discarded_record()
    record.session_opened(State.SLEEPING, drafter=True)
    assert record.snapshot()["weight_update_target"] == "drafter"
    record.session_closed()
    assert record.weights_stale is not None  # only the drafter was written
    record.session_opened(State.SLEEPING)
    record.session_closed()
    assert record.weights_stale is None


def test_a_round_armed_for_a_lora_adapter_does_not_bring_back_discarded_weights() -> None:
    record = discarded_record()
    record.adapter_round_armed = True
    record.session_opened(State.SLEEPING)
    assert record.snapshot()["weight_update_target"] == "lora_adapter"
    record.session_closed()
    assert record.weights_stale is not None
    record.session_opened(State.SLEEPING)  # the arming lasts one round, as in SkyRL's receive engine
    record.session_closed()
    assert record.weights_stale is None


def test_memory_a_worker_rpc_put_to_sleep_stays_asleep_through_reconcile_and_keeps_frozen_requests() -> None:
    ended: list[bool] = []
    metrics = Metrics(
        CollectorRegistry(), version="x", engines=["default"], states=[s.value for s in State], operations=["sleep"]
    ).engine("default")
    record = EngineRecord(metrics, lambda: None, on_weights_discarded=lambda _why: ended.append(True))
    record.reconcile_with(AWAKE)
    record.paused_by_user("keep")
    record.settle(State.PAUSED)
    record.fell_asleep_in_worker(frozenset({"weights", "kv_cache"}))
    record.settle(State.SLEEPING)
    assert record.weights_stale is not None and ended == []  # the pause's frozen requests resume on new weights
    record.reconcile_with(PAUSED_FLAGS)  # vLLM's flags read "paused": no drift
    assert record.state is State.SLEEPING and record.asleep_outside_vllm and not record.drift_events
    record.woke(frozenset({"kv_cache"}))
    assert record.asleep_outside_vllm
    record.woke(frozenset())
    assert not record.asleep_outside_vllm and record.asleep_tags == frozenset()


# ----- what the status page draws (proxy/front/status_page.html)
def test_each_transition_carries_its_time_on_the_proxy_s_clock_for_the_timeline() -> None:
    import time

    started = time.time()
    record = running_record()
    record.reconcile_with(REFUSED)
    snapshot = record.snapshot()
    assert [(t["from"], t["to"]) for t in snapshot["transitions"]] == [("STARTING", "RUNNING"), ("RUNNING", "FAILED")]
    times = [t["at"] for t in snapshot["transitions"]]
    assert started <= snapshot["history_since"] <= times[0] <= times[1] <= snapshot["read_at"] <= time.time()


def test_recent_errors_keep_distinct_errors_and_count_a_repeat_instead_of_flooding() -> None:
    record = running_record()
    for _ in range(30):  # e.g. a sidecar waiting for vLLM to load says so each round
        record.error("engine_starting", "/health is not 200 yet")
    record.error("verification_failed", "memory not freed")
    errors = record.snapshot()["recent_errors"]
    assert [(e["reason"], e["count"]) for e in errors] == [("engine_starting", 30), ("verification_failed", 1)]
    assert errors[0]["first_at"] <= errors[0]["at"] <= errors[1]["at"]
    assert record.snapshot()["last_error"]["reason"] == "verification_failed"
    for n in range(20):
        record.error("upstream_error", f"attempt {n}")
    assert len(record.snapshot()["recent_errors"]) == 10  # bounded


# ----- a pause the proxy did not make, found through a refused request (proxy/upstream/refusals.py)

PAUSED_BY_VLLM = Observation(reachable=True, healthy=True, sleeping=True, paused=True, metric_awake=True)


def test_a_pause_found_through_a_refusal_is_adopted_as_drift_with_its_cause() -> None:
    record = running_record()
    record.reconcile_with(PAUSED_BY_VLLM, cause="engine_paused")
    assert record.state is State.PAUSED
    assert record.user_pause == "abort"  # re-applied after a sleep/wake cycle, like a pause of our own
    (event,) = record.drift_events
    assert (event["before"], event["after"], event["cause"]) == ("RUNNING", "PAUSED", "engine_paused")
    record.reconcile_with(AWAKE)  # a /resume sent to vLLM directly: adopted the same way
    assert record.state is State.RUNNING and record.user_pause is None


def test_the_drift_line_says_what_changed_without_a_timestamp_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """`make run` with `check --lifecycle`: the text log read `drift: ... at=1.79664e+09 before=RUNNING ...`."""
    record = running_record()
    with caplog.at_level(logging.WARNING, logger="lifeguard.lifecycle"):
        record.reconcile_with(PAUSED_BY_VLLM, cause="engine_paused")
    (line,) = [TextFormatter().format(r) for r in caplog.records if "drift" in r.getMessage()]
    assert "before=RUNNING after=PAUSED observed=[true,true] cause=engine_paused" in line, line
    assert " at=" not in line and "e+09" not in line, line
    assert record.drift_events[0]["at"] > 0  # /lifeguard/state still says when


def test_a_refusal_with_vllm_not_paused_changes_nothing() -> None:
    record = running_record()
    record.reconcile_with(AWAKE, cause="engine_paused")
    assert record.state is State.RUNNING and not record.drift_events


# ----- elastic EP (proxy/upstream/elastic_ep.py): read from /is_scaling_elastic_ep, never from /health


def gated(**status: Any) -> Observation:
    return Observation(reachable=True, healthy=True, elastic=ElasticStatus(**status))


def test_a_scaling_engine_is_scaling_and_holds_then_comes_back_as_it_was() -> None:
    record = running_record()
    record.reconcile_with(gated(scaling=True, phase="committing", epoch=3, requested_size=4))
    assert record.state is State.SCALING
    view = record.view()
    assert view.reason is not None and "scaling elastic EP to 4" in view.reason
    assert admission(view, on_sleeping="hold", hold_while_restarted=False) is Admission.HOLD
    refusal = judge(parse_call("sleep", [], b""), view)
    assert isinstance(refusal, Refuse) and refusal.error.reason == "engine_scaling"
    record.reconcile_with(AWAKE)
    assert record.state is State.RUNNING
    assert record.weights_stale is None  # a scale does not change the weights
    assert record.snapshot()["elastic_ep"] is None


def test_an_unreadable_status_is_held_as_scaling_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    record = running_record()
    for _ in range(3):
        record.reconcile_with(gated(problem="the body is not JSON"))
    assert record.state is State.SCALING
    assert [r.message for r in caplog.records].count(
        "vLLM's elastic EP gate is up and its status cannot be read: the body is not JSON; held as scaling"
    ) == 1


def test_a_retired_rank_fails_with_the_reason_and_refuses_everything() -> None:
    record = running_record()
    record.reconcile_with(gated(scaling=False, phase="completed", epoch=2))
    assert record.state is State.FAILED and record.failure_kind is FailureKind.RETIRED
    view = record.view()
    assert admission(view, on_sleeping="hold", hold_while_restarted=False) is Admission.REJECT_FAILED
    error = unavailable(view)
    assert error.reason == "engine_retired" and "retired" in error.message
    control = control_refusal(view)
    assert control is not None and control.reason == "engine_retired"


def test_a_retired_rank_that_answers_again_is_a_new_process_with_stale_weights() -> None:
    record = running_record()
    record.reconcile_with(gated(scaling=False, phase="completed"))
    record.reconcile_with(AWAKE)
    assert record.state is State.RUNNING
    assert record.weights_stale == "restarted"


def test_a_failed_scale_fails_with_vllms_error_and_recovers_without_stale_weights() -> None:
    record = running_record()
    record.reconcile_with(gated(scaling=False, phase="failed", epoch=5, error="rank 1 never committed"))
    assert record.state is State.FAILED and record.failure_kind is FailureKind.ELASTIC_EP
    assert record.last_error is not None and "rank 1 never committed" in record.last_error["message"]
    record.reconcile_with(AWAKE)
    assert record.state is State.RUNNING and record.weights_stale is None


def test_a_sleeping_engine_that_scales_comes_back_asleep() -> None:
    record = running_record()
    record.fell_asleep(1)
    record.settle(State.SLEEPING)
    record.reconcile_with(gated(scaling=True, phase="preparing"))
    assert record.state is State.SCALING
    record.reconcile_with(Observation(reachable=True, healthy=True, sleeping=True, paused=True, metric_level=1,
                                      metric_awake=False))  # fmt: skip
    assert record.state is State.SLEEPING
