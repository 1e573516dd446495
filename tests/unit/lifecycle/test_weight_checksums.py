"""proxy/lifecycle/weight_checksums.py: which calls zero or reload the weights, vLLM's compare, when the checkpoint's
checksums are due; and what a reset does to the record, the gate's admission and the state file."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.config import Settings
from proxy.errors import UpstreamUnreachable
from proxy.lifecycle.persisted_facts import PersistedFacts
from proxy.lifecycle.record import EngineRecord
from proxy.lifecycle.rules import Admission, Staleness, admission, serving_refusal
from proxy.lifecycle.state_file import StateFile
from proxy.lifecycle.states import State
from proxy.lifecycle.weight_checksums import (
    WeightChecksums,
    mismatches,
    named,
    parse_checksums,
    reloads_checkpoint,
    resets_weights,
)
from proxy.observe.metrics import Metrics
from proxy.upstream.observation import Observation
from proxy.upstream.vllm_client import VllmClient

AWAKE = Observation(reachable=True, healthy=True, sleeping=False, paused=False)
REFUSED = Observation(reachable=False, error="connection refused")


def _metrics() -> Metrics:
    return Metrics(
        CollectorRegistry(), version="x", engines=["default"], states=[s.value for s in State], operations=[]
    )


def _checksums(mode: str, session: aiohttp.ClientSession) -> WeightChecksums:
    settings = Settings(upstream="http://127.0.0.1:9", weight_checksums=mode)
    client = VllmClient(session, "http://127.0.0.1:9", control_timeout_s=1.0)
    return WeightChecksums(settings, client, _metrics().engine("default"))


@pytest.mark.parametrize(
    ("path", "body", "zeroes"),
    [
        ("/weight_checker", b'{"action": "reset"}', True),
        ("/weight_checker", b'{"action": "checksum"}', False),
        ("/weight_checker", b'{"action": "compare", "baseline": {}}', False),
        ("/weight_checker", b"not json", False),
        ("/weight_checker", b'["reset"]', False),
        ("/v1/load_lora_adapter", b'{"action": "reset"}', False),
    ],
)
def test_only_the_reset_action_zeroes_the_weights(path: str, body: bytes, zeroes: bool) -> None:
    assert resets_weights(path, body) is zeroes


@pytest.mark.parametrize(
    ("method", "body", "expected"),
    [
        ("reload_weights", b'{"method": "reload_weights"}', True),
        ("reload_weights", b'{"method": "reload_weights", "kwargs": {"is_checkpoint_format": true}}', True),
        ("reload_weights", b'{"method": "reload_weights", "kwargs": {"weights_path": "/m/step-7"}}', False),
        ("reload_weights", b'{"method": "reload_weights", "args": ["/m/step-7"]}', False),
        ("my_reload", b'{"method": "my_reload"}', False),
    ],
)
def test_a_reload_is_of_the_checkpoint_only_without_a_path_of_its_own(method: str, body: bytes, expected: bool) -> None:
    assert reloads_checkpoint(method, body) is expected


def test_mismatches_are_vllms_compare_and_are_named_briefly() -> None:
    assert mismatches({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b", "c"]
    assert mismatches({"a": "1"}, {"a": "1"}) == []
    assert named([f"t{i}" for i in range(10)]) == "t0, t1, t2, t3, t4, t5, t6, t7 and 2 more"


@pytest.mark.parametrize("payload", [None, {}, {"checksums": {}}, {"checksums": {"a": 1}}, {"checksums": ["a"]}])
def test_an_answer_without_checksums_is_refused_saying_why(payload: object) -> None:
    with pytest.raises(ValueError, match="checksum"):
        parse_checksums(payload)


async def _refused(checksums: WeightChecksums) -> None:
    """A call through the checksums' client that nothing accepts (port 9 on loopback: no listener)."""
    with pytest.raises(UpstreamUnreachable, match="refused"):
        await checksums._client.call("POST", "/sleep")


async def test_the_checkpoint_is_due_only_while_the_weights_are_known_to_be_the_checkpoints() -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        checksums = _checksums("reloads", session)
        off = _checksums("off", session)
        checksums.engine_answers()
        assert not checksums.checkpoint_due  # started in front of a running vLLM: its weights may be trained ones
        await _refused(checksums)  # any call's: nothing listens (a lifecycle call's too)
        checksums.engine_answers()  # a process started since
        assert checksums.checkpoint_due
        checksums.weights_changed()  # an update got in first
        assert not checksums.checkpoint_due
        await _refused(checksums)
        checksums.weights_changed()  # the record's own "restarted" mark, made when vLLM is back
        checksums.engine_answers()
        assert checksums.checkpoint_due
        await _refused(off)
        off.engine_answers()
        assert not off.checkpoint_due


async def test_no_checkpoint_known_makes_the_reload_check_unavailable_not_failed() -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        check = await _checksums("reloads", session).check_reload()
        assert check is not None and check.result == "unavailable" and "not known" in check.detail
        assert await _checksums("off", session).check_reload() is None
        assert await _checksums("reloads", session).check_wake() is None  # no level-1 sleep was digested


def _running_record(ended: list[bool]) -> EngineRecord:
    metrics = _metrics().engine("default")
    record = EngineRecord(metrics, lambda: None, on_weights_discarded=lambda _why: ended.append(True))
    record.reconcile_with(AWAKE)
    return record


@pytest.mark.parametrize("reason", [Staleness.RESET, Staleness.MISMATCH])
def test_reset_or_mismatched_weights_hold_inference_until_weights_are_loaded(reason: Staleness) -> None:
    ended: list[bool] = []
    record = _running_record(ended)
    if reason is Staleness.RESET:
        record.weights_reset()
        assert ended == [True]  # what vLLM queued would run on zeroed weights
    else:
        record.mark_stale(reason)
    view = record.view()
    assert admission(view, on_sleeping="hold", hold_while_restarted=False) is Admission.HOLD
    refusal = serving_refusal(view, on_sleeping="hold", hold_while_restarted=False, closed=False)
    assert refusal is not None and refusal.details["cause"] == f"weights_{reason}"
    assert record.snapshot()["weights_stale_reason"] == reason
    record.weights_loaded("a reload through /collective_rpc")
    assert admission(record.view(), on_sleeping="hold", hold_while_restarted=False) is Admission.FORWARD


def test_a_restart_seen_after_a_reset_keeps_the_weights_held() -> None:
    record = _running_record([])
    record.weights_reset()
    record.reconcile_with(REFUSED)
    record.reconcile_with(AWAKE)  # back: looks like a restart, may be a /health that failed and came back
    assert record.weights_stale is Staleness.RESET


def test_a_reset_reads_back_from_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    StateFile(str(path)).save(PersistedFacts(Staleness.RESET))
    assert json.loads(path.read_text())["weights_stale"] == "reset"
    assert StateFile(str(path)).load() == PersistedFacts(Staleness.RESET)
