"""`StateFile`: the facts about an engine that vLLM cannot be asked for, kept so a restarted proxy keeps them.

vLLM does not show that its weights were discarded once it is awake again, a pause to re-apply on the wake, the
tags still asleep after a partial wake, a sleep the GPUs never confirmed, a weight-update session, or the weights'
checksums a level-1 wake must bring back. The file is pessimistic: "discarded"
is written before a level-2 sleep is sent and cleared only once weights were loaded again. Writes are atomic (a
temporary file renamed over the old one). docs/design.md tells why each fact is kept.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from .persisted_facts import PersistedFacts
from .prefix_cache import Partition
from .rules import ALL_SLEEP_TAGS, SessionTarget, Staleness
from .states import State
from .weight_version import WeightVersion

log = logging.getLogger("lifeguard.state_file")


# What a state file that cannot be read means: the weights cannot be vouched for.
UNREADABLE = PersistedFacts(weights_stale=Staleness.DISCARDED)


class StateFile:
    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._saved: PersistedFacts | None = None
        self._failing = False  # the last write failed: said once, not at every change

    @property
    def enabled(self) -> bool:
        return self._path is not None

    def load(self) -> PersistedFacts | None:
        """The previous proxy's facts; None on a first start (no file, or no file configured)."""
        if self._path is None or not self._path.exists():
            return None
        try:
            raw = json.loads(self._path.read_text())
            stale = raw.get("weights_stale")
            facts = PersistedFacts(
                weights_stale=None if stale is None else Staleness(stale),
                user_pause=raw.get("user_pause"),
                asleep_tags=tuple(raw.get("asleep_tags", ())),
                sleep_level=raw.get("sleep_level"),
                sleep_unconfirmed=raw.get("sleep_unconfirmed", False),
                asleep_outside_vllm=raw.get("asleep_outside_vllm", False),
                prefix_partition=Partition.from_dict(raw.get("prefix_partition")),
                weight_update_session=raw.get("weight_update_session"),
                session_returns_to=raw.get("session_returns_to"),
                weights_before_sleep=raw.get("weights_before_sleep"),
                weight_version=WeightVersion.from_dict(raw.get("weight_version")),
                weights_partial_after=raw.get("weights_partial_after"),
                offload_tier_kept=raw.get("offload_tier_kept", False),
            )
        except (OSError, ValueError, AttributeError, TypeError) as exc:  # ValueError: bad JSON, or no such Staleness
            log.warning("state file %s unreadable (%r): weights treated as stale", self._path, exc)
            return UNREADABLE
        if not _well_formed(facts):
            log.warning("state file %s malformed (%s): weights treated as stale", self._path, facts)
            return UNREADABLE
        self._saved = facts
        return facts

    def save(self, facts: PersistedFacts) -> None:
        if self._path is None or facts == self._saved:
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(asdict(facts)))
            os.replace(tmp, self._path)
        except OSError as exc:
            if not self._failing:
                log.error("could not write the state file %s: %s; it is tried again at each change", self._path,
                          exc.strerror or type(exc).__name__, extra={"event": "state_file_failed"})  # fmt: skip
            self._failing = True
            return
        if self._failing:
            log.info("the state file %s is written again", self._path, extra={"event": "state_file_written"})
        self._failing = False
        self._saved = facts


def _well_formed(facts: PersistedFacts) -> bool:
    return (
        isinstance(facts.user_pause, str | None)
        and isinstance(facts.sleep_unconfirmed, bool)
        and isinstance(facts.asleep_outside_vllm, bool)
        and all(tag in ALL_SLEEP_TAGS or tag == "scheduling" for tag in facts.asleep_tags)
        and (facts.sleep_level is None or (type(facts.sleep_level) is int and 0 <= facts.sleep_level <= 2))
        and facts.weight_update_session in (None, *SessionTarget)
        and facts.session_returns_to in (None, *(state.value for state in State))
        and isinstance(facts.weights_before_sleep, str | None)
        and isinstance(facts.weights_partial_after, str | None)
        and isinstance(facts.offload_tier_kept, bool)
    )
