"""lifecycle/stall.py: a stall is counted from vLLM's last byte, or from when requests went in flight after none was."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from proxy.lifecycle.inflight import InFlightRequests
from proxy.lifecycle.record import EngineRecord
from proxy.lifecycle.stall import StallWatch
from proxy.lifecycle.states import State
from proxy.observe.metrics import EngineMetrics, Metrics


class _Request:
    def abort(self, message: str) -> bool:
        return True


def _watch() -> tuple[StallWatch, InFlightRequests, EngineRecord]:
    family = Metrics(CollectorRegistry(), version="x", engines=["default"], states=[s.value for s in State],
                     operations=[])  # fmt: skip
    metrics = EngineMetrics(family, "default")
    record = EngineRecord(metrics, lambda: None)
    record.settle(State.RUNNING)
    inflight = InFlightRequests()
    return StallWatch(10.0, inflight, record, metrics), inflight, record


def test_a_request_sent_after_a_long_idle_time_is_not_taken_for_a_stall() -> None:
    watch, inflight, record = _watch()
    inflight.last_progress = time.monotonic() - 3600  # an hour idle
    inflight.add(_Request())
    watch.look()
    assert record.stalled_for is None


def test_no_byte_for_longer_than_the_setting_is_a_stall_and_a_byte_clears_it() -> None:
    watch, inflight, record = _watch()
    inflight.add(_Request())
    inflight.last_progress = time.monotonic() - 11
    watch.look()
    assert record.stalled_for is not None and record.stalled_for >= 11
    inflight.progressed()
    watch.look()
    assert record.stalled_for is None
