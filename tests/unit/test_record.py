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
