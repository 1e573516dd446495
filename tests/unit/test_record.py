"""EngineRecord, sans-IO: what one reconcile observation means for the state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.metrics import Metrics
from proxy.observation import Observation
from proxy.record import EngineRecord
from proxy.states import State

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
    record = EngineRecord(metrics, lambda: None, on_weights_discarded=lambda: ended.append(True))
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


# ----- what the status page draws (proxy/status_page.html)
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
