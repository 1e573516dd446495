"""The metrics contract: names, types, closed label sets, series present before the first event, and an
`engine` label on every series about an engine (one shape for one engine or many)."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe import metrics as m
from proxy.observe.metrics import EngineMetrics, Metrics

TRANSITIONS = "lifeguard_state_transitions_total"
OPS_TOTAL = "lifeguard_lifecycle_operations_total"
OP_BUCKET = "lifeguard_lifecycle_operation_duration_seconds_bucket"
STATES = ("STARTING", "RUNNING", "SLEEPING", "WAKING", "FAILED")
OPERATIONS = ("sleep", "wake_up", "pause", "resume")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


ENGINES = ("default", "judge")
#: Series about the proxy itself, not about one engine: no `engine` label.
PROXY_SERIES = ("lifeguard_build_info", "lifeguard_proxy_errors_total")


def family(registry: CollectorRegistry, **kwargs: object) -> Metrics:
    return Metrics(registry, version="1.2.3", engines=ENGINES, states=STATES, operations=OPERATIONS, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def metrics(registry: CollectorRegistry) -> EngineMetrics:
    return family(registry).engine("default")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A sample of engine `default` (or of the engine named), or of the proxy's own series."""
    if name not in PROXY_SERIES:
        labels.setdefault("engine", "default")
    return registry.get_sample_value(name, labels)


def families(registry: CollectorRegistry) -> dict[str, str]:
    text = generate_latest(registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


EXPECTED_FAMILIES = {
    "lifeguard_build_info": "gauge",
    "lifeguard_state": "gauge",
    "lifeguard_state_entered_timestamp_seconds": "gauge",
    "lifeguard_state_transitions": "counter",
    "lifeguard_lifecycle_operations": "counter",
    "lifeguard_lifecycle_operation_duration_seconds": "histogram",
    "lifeguard_held_requests": "gauge",
    "lifeguard_hold_duration_seconds": "histogram",
    "lifeguard_inference_requests": "counter",
    "lifeguard_inflight_requests": "gauge",
    "lifeguard_upstream_response_latency_seconds": "histogram",
    "lifeguard_request_duration_seconds": "histogram",
    "lifeguard_verification_checks": "counter",
    "lifeguard_lies_caught": "counter",
    "lifeguard_drift_events": "counter",
    "lifeguard_engine_restarts": "counter",
    "lifeguard_weights_stale": "gauge",
    "lifeguard_gpu_memory_used_bytes": "gauge",
    "lifeguard_gpu_memory_total_bytes": "gauge",
    "lifeguard_gpu_probe_available": "gauge",
    "lifeguard_policy_actions": "counter",
    "lifeguard_proxy_errors": "counter",
    "lifeguard_swaps": "counter",
    "lifeguard_swap_duration_seconds": "histogram",
    "lifeguard_gpu_lock_waits": "counter",
    "lifeguard_gpu_lock_wait_seconds": "histogram",
}


def test_exposition_parses_and_has_every_family_with_its_type(metrics: EngineMetrics, registry: CollectorRegistry):
    found = families(registry)
    for name, kind in EXPECTED_FAMILIES.items():
        assert found.get(name) == kind, name
    assert all(name.startswith("lifeguard_") for name in found)


def test_every_known_label_set_reads_zero_before_the_first_event(metrics: EngineMetrics, registry: CollectorRegistry):
    for op in OPERATIONS:
        for outcome in m.OPERATION_OUTCOMES:
            assert value(registry, OPS_TOTAL, operation=op, outcome=outcome) == 0
        assert value(registry, "lifeguard_lifecycle_operation_duration_seconds_count", operation=op) == 0
        for check in m.CHECKS:
            assert value(registry, "lifeguard_lies_caught_total", operation=op, check=check) == 0
    for outcome in m.INFERENCE_OUTCOMES:
        assert value(registry, "lifeguard_inference_requests_total", outcome=outcome) == 0
    for outcome in m.HOLD_OUTCOMES:
        assert value(registry, "lifeguard_hold_duration_seconds_count", outcome=outcome) == 0
    for route in m.ROUTE_CLASSES:
        assert value(registry, "lifeguard_request_duration_seconds_count", route_class=route) == 0
    for check in m.CHECKS:
        for result in m.CHECK_RESULTS:
            assert value(registry, "lifeguard_verification_checks_total", check=check, result=result) == 0
    for policy in m.POLICIES:
        assert value(registry, "lifeguard_policy_actions_total", policy=policy) == 0
    for src in STATES:
        for dst in STATES:
            expected = None if src == dst else 0
            assert value(registry, TRANSITIONS, from_state=src, to_state=dst) == expected
    for name in (
        "lifeguard_held_requests",
        "lifeguard_inflight_requests",
        "lifeguard_drift_events_total",
        "lifeguard_engine_restarts_total",
        "lifeguard_weights_stale",
        "lifeguard_gpu_probe_available",
        "lifeguard_upstream_response_latency_seconds_count",
    ):
        assert value(registry, name) == 0, name
    assert value(registry, "lifeguard_build_info", version="1.2.3") == 1


def test_state_starts_at_the_first_state_and_follows_transitions(metrics: EngineMetrics, registry: CollectorRegistry):
    assert value(registry, "lifeguard_state", lifeguard_state="STARTING") == 1
    metrics.state_changed("STARTING", "RUNNING")
    metrics.state_changed("RUNNING", "SLEEPING")
    assert value(registry, "lifeguard_state", lifeguard_state="SLEEPING") == 1
    assert sum(value(registry, "lifeguard_state", lifeguard_state=s) or 0 for s in STATES) == 1
    assert value(registry, TRANSITIONS, from_state="RUNNING", to_state="SLEEPING") == 1
    assert value(registry, "lifeguard_state_entered_timestamp_seconds") > 1_600_000_000


def test_edges_narrow_the_pre_created_transitions(registry: CollectorRegistry):
    metrics = family(registry, edges=[("STARTING", "RUNNING")]).engine("default")
    assert value(registry, TRANSITIONS, from_state="STARTING", to_state="RUNNING") == 0
    assert value(registry, TRANSITIONS, from_state="RUNNING", to_state="FAILED") is None
    metrics.state_changed("RUNNING", "FAILED")  # an edge not listed is still counted, not dropped
    assert value(registry, TRANSITIONS, from_state="RUNNING", to_state="FAILED") == 1


def test_unknown_label_values_raise_instead_of_inventing_series(metrics: EngineMetrics):
    with pytest.raises(KeyError):
        metrics.inference_finished("rejected", 0.1)
    with pytest.raises(KeyError):
        metrics.operation_finished("sleep", "failed", 0.1)
    with pytest.raises(KeyError):
        metrics.operation_finished("reboot", "ok", 0.1)
    with pytest.raises(KeyError):
        metrics.hold_finished("engine_sleeping", 0.1)  # an inference outcome, not a hold outcome
    with pytest.raises(KeyError):
        metrics.request_duration("/v1/completions", 0.1)
    with pytest.raises(KeyError):
        metrics.state_changed("RUNNING", "EXPLODED")


def test_each_method_moves_its_own_series(metrics: EngineMetrics, registry: CollectorRegistry):
    metrics.operation_finished("wake_up", "upstream_error", 42.0)
    assert value(registry, OPS_TOTAL, operation="wake_up", outcome="upstream_error") == 1
    assert value(registry, "lifeguard_lifecycle_operation_duration_seconds_sum", operation="wake_up") == 42.0
    assert value(registry, "lifeguard_lifecycle_operation_duration_seconds_bucket", operation="wake_up", le="30.0") == 0
    assert value(registry, "lifeguard_lifecycle_operation_duration_seconds_bucket", operation="wake_up", le="60.0") == 1
    metrics.watch_counts(lambda: 7, lambda: 3)
    assert value(registry, "lifeguard_held_requests") == 7
    assert value(registry, "lifeguard_inflight_requests") == 3
    metrics.hold_finished("hold_timeout", 300.0)
    assert value(registry, "lifeguard_hold_duration_seconds_count", outcome="hold_timeout") == 1
    metrics.inference_finished("stream_broken", 0.1)
    assert value(registry, "lifeguard_inference_requests_total", outcome="stream_broken") == 1
    assert value(registry, "lifeguard_request_duration_seconds_sum", route_class="inference") == 0.1
    metrics.upstream_latency(0.02)
    assert value(registry, "lifeguard_upstream_response_latency_seconds_count") == 1
    metrics.request_duration("lifecycle", 1.5)
    assert value(registry, "lifeguard_request_duration_seconds_sum", route_class="lifecycle") == 1.5
    metrics.verification("memory", "fail")
    assert value(registry, "lifeguard_verification_checks_total", check="memory", result="fail") == 1
    metrics.lie_caught("wake_up", "flags")
    assert value(registry, "lifeguard_lies_caught_total", operation="wake_up", check="flags") == 1
    metrics.drift()
    metrics.engine_restart()
    metrics.engine_restart()
    assert value(registry, "lifeguard_drift_events_total") == 1
    assert value(registry, "lifeguard_engine_restarts_total") == 2
    metrics.weights_stale(True)
    assert value(registry, "lifeguard_weights_stale") == 1
    metrics.weights_stale(False)
    assert value(registry, "lifeguard_weights_stale") == 0
    metrics.gpu_memory("0", 30 * 2**30, 80 * 2**30)
    assert value(registry, "lifeguard_gpu_memory_used_bytes", gpu="0") == 30 * 2**30
    assert value(registry, "lifeguard_gpu_memory_total_bytes", gpu="0") == 80 * 2**30
    metrics.gpu_probe_available(True)
    assert value(registry, "lifeguard_gpu_probe_available") == 1
    metrics.policy_action("idle_sleep")
    assert value(registry, "lifeguard_policy_actions_total", policy="idle_sleep") == 1


def test_lifecycle_buckets_reach_ten_minutes():
    assert m.LIFECYCLE_BUCKETS[0] == 0.01
    assert m.LIFECYCLE_BUCKETS[-1] == 600.0
    assert list(m.LIFECYCLE_BUCKETS) == sorted(m.LIFECYCLE_BUCKETS)


def test_two_instances_on_separate_registries_do_not_collide():
    a, b = CollectorRegistry(), CollectorRegistry()
    family(a).engine("default").drift()
    family(b)
    assert value(a, "lifeguard_drift_events_total") == 1
    assert value(b, "lifeguard_drift_events_total") == 0


def test_inference_outcomes_include_every_hold_outcome():
    assert set(m.HOLD_OUTCOMES) <= set(m.INFERENCE_OUTCOMES)
    assert len(set(m.INFERENCE_OUTCOMES)) == len(m.INFERENCE_OUTCOMES)


def test_exposition_is_what_the_scraper_asks_for(metrics: EngineMetrics) -> None:
    metrics.drift()
    whole = metrics._family
    text, content_type = whole.exposition(None)
    assert content_type.startswith("text/plain")
    assert b'lifeguard_drift_events_total{engine="default"} 1.0' in text
    openmetrics, content_type = whole.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and openmetrics.endswith(b"# EOF\n")


def test_each_engine_has_its_own_series_and_the_proxy_its_own(registry: CollectorRegistry) -> None:
    whole = family(registry)
    whole.engine("judge").inference_finished("forwarded", 0.1)
    whole.engine("judge").proxy_error("forward")
    whole.engine("judge").gpu_memory("0", 1, 2)
    assert value(registry, "lifeguard_inference_requests_total", engine="judge", outcome="forwarded") == 1
    assert value(registry, "lifeguard_inference_requests_total", outcome="forwarded") == 0
    assert value(registry, "lifeguard_proxy_errors_total", where="forward") == 1
    for metric in registry.collect():
        labelled = [sample.labels for sample in metric.samples]
        if metric.name in ("lifeguard_build", "lifeguard_proxy_errors"):
            assert all("engine" not in labels for labels in labelled), metric.name
        else:
            assert all(labels.get("engine") in ENGINES for labels in labelled), metric.name


@pytest.mark.prometheus  # make test-observability installs promtool and runs it
def test_exposition_passes_promtool_check_metrics(metrics: EngineMetrics, registry: CollectorRegistry):
    metrics.state_changed("STARTING", "RUNNING")
    metrics.gpu_memory("0", 1, 2)
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_swap_series_exist_at_zero_for_every_engine_and_count_each_swap(registry: CollectorRegistry) -> None:
    whole = family(registry)
    for engine in ENGINES:
        for outcome in m.SWAP_OUTCOMES:
            assert registry.get_sample_value("lifeguard_swaps_total", {"engine": engine, "outcome": outcome}) == 0
    whole.swap_finished("judge", "ok", 1.5)
    whole.swap_finished("judge", "no_room", 0.1)
    assert registry.get_sample_value("lifeguard_swaps_total", {"engine": "judge", "outcome": "ok"}) == 1
    assert registry.get_sample_value("lifeguard_swap_duration_seconds_count", {"engine": "judge"}) == 1
    with pytest.raises(KeyError):
        whole.swap_finished("judge", "maybe", 0.0)


def test_gpu_lock_waits_exist_at_zero_for_every_engine_and_time_only_the_waits_that_took_the_lock(
    registry: CollectorRegistry,
) -> None:
    from proxy.sharing.gpu_lock import WAIT_OUTCOMES

    assert m.GPU_LOCK_OUTCOMES == WAIT_OUTCOMES
    whole = family(registry)
    for engine in ENGINES:
        for outcome in m.GPU_LOCK_OUTCOMES:
            assert value(registry, "lifeguard_gpu_lock_waits_total", engine=engine, outcome=outcome) == 0
        assert value(registry, "lifeguard_gpu_lock_wait_seconds_count", engine=engine) == 0
    whole.gpu_lock_waited("judge", "waited", 2.5)
    whole.gpu_lock_waited("judge", "busy", 60.0)
    assert value(registry, "lifeguard_gpu_lock_waits_total", engine="judge", outcome="waited") == 1
    assert value(registry, "lifeguard_gpu_lock_waits_total", engine="judge", outcome="busy") == 1
    assert value(registry, "lifeguard_gpu_lock_wait_seconds_count", engine="judge") == 1
    assert value(registry, "lifeguard_gpu_lock_wait_seconds_sum", engine="judge") == 2.5
    with pytest.raises(KeyError):
        whole.gpu_lock_waited("judge", "maybe", 0.0)
