"""The request-path series kept as plain numbers export what prometheus_client's own Histogram and Counter would
for the same events: prometheus_client is the oracle, in the text format and in OpenMetrics."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from proxy.observe.metrics import REQUEST_BUCKETS
from proxy.observe.request_metrics import CounterFamily, HistogramFamily

OUTCOMES = ("forwarded", "client_gone", "stream_broken")


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics], ids=["text", "openmetrics"])
def test_folded_series_export_what_prometheus_client_exports_for_the_same_events(generate):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = HistogramFamily("lg_latency_seconds", "Latency.", ["engine", "route_class"], REQUEST_BUCKETS)
    counter = CounterFamily("lg_requests", "Requests.", ["engine", "outcome"], OUTCOMES)
    ours.register(histogram)
    ours.register(counter)
    reference_histogram = Histogram(
        "lg_latency_seconds", "Latency.", ["engine", "route_class"], buckets=REQUEST_BUCKETS, registry=theirs
    )
    reference_counter = Counter("lg_requests", "Requests.", ["engine", "outcome"], registry=theirs)
    for engine in ("a", "b"):
        for route in ("inference", "passthrough"):
            histogram.labels(engine, route)
            reference_histogram.labels(engine, route)
        counter.counts(engine)
        for outcome in OUTCOMES:
            reference_counter.labels(engine, outcome)

    draw = random.Random(7)
    # Values on the bounds themselves count in that bucket ("le"); beyond the last bound, in +Inf.
    values = [*REQUEST_BUCKETS, 0.0, 1e-9, 601.0, 1e6] + [draw.expovariate(2.0) for _ in range(500)]
    for value in values:
        engine, route = draw.choice("ab"), draw.choice(("inference", "passthrough"))
        histogram.labels(engine, route).observe(value)
        reference_histogram.labels(engine, route).observe(value)
        outcome = draw.choice(OUTCOMES)
        counter.counts(engine)[outcome] += 1
        reference_counter.labels(engine, outcome).inc()

    assert _without_created(generate(ours)) == _without_created(generate(theirs))


def test_a_series_reads_zero_before_its_first_event_and_an_unknown_outcome_is_a_key_error():
    registry = CollectorRegistry()
    counter = CounterFamily("lg_requests", "Requests.", ["engine", "outcome"], OUTCOMES)
    histogram = HistogramFamily("lg_latency_seconds", "Latency.", ["engine"], REQUEST_BUCKETS)
    registry.register(counter)
    registry.register(histogram)
    counts = counter.counts("a")
    histogram.labels("a")
    assert registry.get_sample_value("lg_requests_total", {"engine": "a", "outcome": "forwarded"}) == 0
    assert registry.get_sample_value("lg_latency_seconds_count", {"engine": "a"}) == 0
    with pytest.raises(KeyError):
        counts["forwarded_typo"] += 1
