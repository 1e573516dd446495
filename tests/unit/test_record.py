"""EngineRecord, sans-IO: what one reconcile observation means for the state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.metrics import Metrics
from proxy.record import SLOW_ROUNDS_BEFORE_LOST, EngineRecord
from proxy.states import State
from proxy.upstream import Observation

AWAKE = Observation(reachable=True, healthy=True, sleeping=False, paused=False)
SLOW = Observation(reachable=False, timed_out=True, error="vLLM did not answer GET /health within 10 s")
REFUSED = Observation(reachable=False, error="connection refused")


def running_record() -> EngineRecord:
    metrics = Metrics(CollectorRegistry(), version="x", states=[s.value for s in State], operations=["sleep"])
    record = EngineRecord(metrics, lambda: None)
    record.reconcile_with(AWAKE)
    assert record.state is State.RUNNING
    return record


def test_a_health_check_that_times_out_is_not_an_engine_death_until_it_keeps_doing_so() -> None:
    record = running_record()
    for _ in range(SLOW_ROUNDS_BEFORE_LOST - 1):
        record.reconcile_with(SLOW)
        assert record.state is State.RUNNING  # a busy API server, not a lost engine
    record.reconcile_with(AWAKE)
    record.reconcile_with(SLOW)  # an answer in between starts the count again
    assert record.state is State.RUNNING and record.weights_stale is None

    for _ in range(SLOW_ROUNDS_BEFORE_LOST - 1):
        record.reconcile_with(SLOW)
    assert record.state is State.FAILED and record.failure_kind == "unreachable"


def test_a_refused_connection_fails_the_engine_at_once() -> None:
    record = running_record()
    record.reconcile_with(REFUSED)
    assert record.state is State.FAILED
