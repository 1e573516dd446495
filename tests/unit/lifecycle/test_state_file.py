"""The state file: what a restarted proxy reads back, and what it makes of a file it cannot trust."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.lifecycle.persisted_facts import PersistedFacts
from proxy.lifecycle.rules import Staleness
from proxy.lifecycle.state_file import UNREADABLE, StateFile


def test_a_saved_state_file_reads_back_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    facts = PersistedFacts(Staleness.DISCARDED, "keep", ("kv_cache", "weights"), 1, sleep_unconfirmed=True)
    StateFile(str(path)).save(facts)
    assert StateFile(str(path)).load() == facts


def test_a_sleep_behind_vllms_executor_reads_back_as_such(tmp_path: Path) -> None:
    # vLLM's flags then read "paused": only the state file says its /wake_up and /resume must not be sent.
    path = tmp_path / "state.json"
    facts = PersistedFacts(Staleness.DISCARDED, "keep", ("kv_cache", "weights"), None, asleep_outside_vllm=True)
    StateFile(str(path)).save(facts)
    assert StateFile(str(path)).load() == facts


def test_an_open_weight_update_session_reads_back_and_is_said_in_words(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    facts = PersistedFacts(Staleness.DISCARDED, weight_update_session="model", session_returns_to="PAUSED")
    StateFile(str(path)).save(facts)
    assert StateFile(str(path)).load() == facts
    assert str(facts) == "weights discarded; a weight update session open on the model"


def test_the_weights_checksums_before_a_sleep_read_back_as_one_digest(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    facts = PersistedFacts(asleep_tags=("kv_cache", "weights"), sleep_level=1, weights_before_sleep="ab" * 32)
    StateFile(str(path)).save(facts)
    assert StateFile(str(path)).load() == facts
    assert str(facts).endswith("the weights' checksums before the sleep")


def test_a_kept_offload_tier_reads_back_and_is_said_in_words(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    facts = PersistedFacts(asleep_tags=("kv_cache", "weights"), sleep_level=1, offload_tier_kept=True)
    StateFile(str(path)).save(facts)
    assert StateFile(str(path)).load() == facts
    assert str(facts).endswith("the KV connector's offload tier kept through a sleep")


def test_a_state_file_from_before_the_asleep_tags_reads_as_nothing_asleep(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"weights_stale": None, "user_pause": None}))
    assert StateFile(str(path)).load() == PersistedFacts()


@pytest.mark.parametrize(
    "raw",
    [
        {"asleep_tags": ["weights", "gpu0"]},
        {"asleep_tags": "weights"},
        {"asleep_tags": ["weights"], "sleep_level": 7},
        {"sleep_level": "1"},
        {"user_pause": 3},
        {"asleep_tags": ["weights"], "sleep_unconfirmed": "yes"},
        {"weights_stale": "maybe"},
        {"weight_update_session": "everything"},
        {"weight_update_session": "model", "session_returns_to": "ASLEEP"},
        {"weights_before_sleep": {"tp0:w": "ab"}},
        {"offload_tier_kept": "yes"},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_state_file_means_the_weights_cannot_be_vouched_for(tmp_path: Path, raw: object) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(raw))
    assert StateFile(str(path)).load() == UNREADABLE


def test_no_file_is_a_first_start(tmp_path: Path) -> None:
    assert StateFile(str(tmp_path / "absent.json")).load() is None
    assert StateFile(None).load() is None
