"""The weight version's rule, sans-IO (proxy/lifecycle/weight_version.py): when it advances, which label it takes,
how vLLM's spans are named, and what the state file keeps of it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from proxy.lifecycle.rules import Staleness
from proxy.lifecycle.state_file import PersistedFacts, StateFile
from proxy.lifecycle.weight_version import WeightVersions, label_sent, vouched_spans, with_label
from proxy.observe.version_metrics import EngineVersionMetrics


def _versions() -> tuple[WeightVersions, list[Any]]:
    seen: list[Any] = []
    metrics = SimpleNamespace(
        generation=lambda g: seen.append(("generation", g)),
        went_partial=lambda: seen.append("partial"),
        relabel_unchanged=lambda: seen.append("unchanged"),
    )
    return WeightVersions(cast(EngineVersionMetrics, metrics), lambda: seen.append("saved")), seen


def test_a_change_takes_the_announced_label_else_the_proxys_own() -> None:
    versions, seen = _versions()
    assert (versions.current.generation, versions.current.label, versions.current.vllm_label) == (
        0,
        "lifeguard-0",
        "default",
    )
    assert versions.label_next(None) == "lifeguard-1"
    assert versions.advanced("a session").label == "lifeguard-1"
    versions.label_next("step-9")
    assert (versions.advanced("a session").label, versions.current.generation) == ("step-9", 2)
    # A reload announces nothing: the proxy's own label, vLLM still holding the last one it was told.
    reload = versions.advanced("a reload")
    assert (reload.label, reload.vllm_label) == ("lifeguard-3", "step-9")
    assert versions.advanced("vLLM restarted", "default").vllm_label == "default"
    assert seen.count(("generation", 4)) == 1


def test_a_failed_change_publishes_nothing_and_partial_weights_keep_the_last_label() -> None:
    versions, seen = _versions()
    versions.label_next("v1")
    versions.went_partial("/update_weights (500)")
    assert versions.advanced("the next whole session").label == "lifeguard-1"  # v1 was never published
    assert versions.partial_after is None and "partial" in seen


def test_a_relabel_says_whether_anything_changed_since_the_last_label() -> None:
    versions, _ = _versions()
    assert versions.relabeled("a") is None  # nothing seen since this proxy started: it cannot tell
    assert versions.relabeled("b") is True
    versions.advanced("a session")
    assert versions.relabeled("c") is False
    assert (versions.current.label, versions.current.vllm_label, versions.current.generation) == ("c", "c", 1)


def test_vllms_spans_take_the_labels_of_the_versions_that_produced_them() -> None:
    versions, _ = _versions()
    versions.advanced("a reload")  # vLLM still says "default"
    versions.label_next("v2")
    versions.advanced("a session")
    lived = versions.since(0)
    spans = [{"version": "default", "start": 0, "end": 4}, {"version": "v2", "start": 4, "end": 9}]
    assert vouched_spans(spans, lived) == [
        {"version": "lifeguard-1", "start": 0, "end": 4},  # the newest version vLLM knew as "default"
        {"version": "v2", "start": 4, "end": 9},
    ]
    # A label vLLM was given behind the proxy's back: the version at the same place.
    assert vouched_spans([{"version": "bogus", "start": 0, "end": 2}], versions.since(2)) == [
        {"version": "v2", "start": 0, "end": 2}
    ]


def test_the_finish_body_carries_the_label_and_a_bad_one_is_left_for_vllm() -> None:
    assert label_sent(b'{"weight_version": "v3"}', "weight_version") == "v3"
    assert label_sent(b'{"weight_version": 3}', "weight_version") is None
    assert label_sent(b"", "weight_version") is None
    assert with_label(b"", "lifeguard-1") == b'{"weight_version": "lifeguard-1"}'
    assert with_label(b'{"x": 1}', "l") == b'{"x": 1, "weight_version": "l"}'
    assert with_label(b"[1]", "l") is None and with_label(b"{", "l") is None


def test_the_header_value_is_printable_ascii() -> None:
    versions, _ = _versions()
    versions.relabeled("step 7\r\nX-Evil: é")
    assert versions.current.header_value == b"step%207%0D%0AX-Evil:%20%C3%A9"


def test_the_state_file_keeps_the_version_and_partial_weights(tmp_path: Path) -> None:
    versions, _ = _versions()
    versions.label_next("v4")
    versions.advanced("a session")
    path = tmp_path / "state.json"
    StateFile(str(path)).save(
        PersistedFacts(Staleness.PARTIAL, weight_version=versions.current, weights_partial_after="/update_weights")
    )
    facts = StateFile(str(path)).load()
    assert facts is not None and facts.weight_version == versions.current
    assert (facts.weights_stale, facts.weights_partial_after) == (Staleness.PARTIAL, "/update_weights")
    restarted, _ = _versions()
    restarted.remember(facts.weight_version, facts.weights_partial_after)
    assert (restarted.current.label, restarted.advanced("a reload").generation) == ("v4", 2)


def test_a_state_file_with_a_broken_version_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"weight_version": {"generation": "one", "label": 1}}')
    facts = StateFile(str(path)).load()
    assert facts is not None and facts.weights_stale is Staleness.DISCARDED  # UNREADABLE
