"""`StateMemo`: the facts about the engine that vLLM cannot be asked for, kept in a file so that a proxy
restarted beside the same vLLM (a sidecar OOM-killed or updated) does not forget them.

vLLM shows whether it sleeps and, through its `engine_sleep_state` gauge, at which level; it does not show
that its weights were discarded by a level-2 sleep once it is awake again (the gauge reads awake after any
full wake), nor a pause the proxy recorded to re-apply on the wake, nor which tags are still asleep after a
`/wake_up` that answered 200 without waking (the gauge then reads awake, and the flags "asleep and paused"
read exactly like a pause), nor that a sleep was never confirmed by the GPUs (a /sleep from PAUSED that did
nothing: its repeat must reach vLLM). Without the memo a new proxy would see an awake or merely paused engine
and release inference or a weight reload onto weights that are discarded or asleep, or answer a sleep of a
merely paused engine as a no-op.

The memo is pessimistic: "discarded" is written *before* a level-2 sleep is sent (a proxy killed while it
runs may never learn its outcome) and cleared only once the weights were loaded again. A vLLM restarted
while no proxy watched holds its checkpoint, yet the memo still says "discarded": inference is held until a
reload, never run on weights the proxy cannot vouch for. Writes are atomic (a temporary file renamed over
the old one), so a kill mid-write leaves the previous memo.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .prefix_cache import Partition
from .rules import ALL_SLEEP_TAGS, Staleness

log = logging.getLogger("lifeguard.memo")


@dataclass(frozen=True)
class Memo:
    # Why the weights vLLM holds were not the intended ones; None: they were valid.
    weights_stale: Staleness | None = None
    # The pause to re-apply on the next wake (a /pause recorded while asleep).
    user_pause: str | None = None
    # What the proxy held to be asleep, and at which level: only a verified wake clears them.
    asleep_tags: tuple[str, ...] = ()
    sleep_level: int | None = None
    # The flags read asleep but nothing was freed (a /sleep from PAUSED that did nothing reads the same): a
    # repeat of that sleep is sent to vLLM, not answered as a no-op.
    sleep_unconfirmed: bool = False
    # The asleep tags were put to sleep by a worker RPC behind vLLM's executor (skyrl_sleep_for_weight_sync):
    # vLLM's flags read "paused", and only that RPC's wake brings them back.
    asleep_outside_vllm: bool = False
    # vLLM's prefix cache may hold blocks computed by older weights; admitted inference carries this salt.
    prefix_partition: Partition | None = None


# What a memo that cannot be read means: the weights cannot be vouched for.
UNREADABLE = Memo(weights_stale=Staleness.DISCARDED)


class StateMemo:
    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._saved: Memo | None = None

    @property
    def enabled(self) -> bool:
        return self._path is not None

    def load(self) -> Memo | None:
        """The previous proxy's memo; None on a first start (no file, or no file configured)."""
        if self._path is None or not self._path.exists():
            return None
        try:
            raw = json.loads(self._path.read_text())
            stale = raw.get("weights_stale")
            memo = Memo(
                weights_stale=None if stale is None else Staleness(stale),
                user_pause=raw.get("user_pause"),
                asleep_tags=tuple(raw.get("asleep_tags", ())),
                sleep_level=raw.get("sleep_level"),
                sleep_unconfirmed=raw.get("sleep_unconfirmed", False),
                asleep_outside_vllm=raw.get("asleep_outside_vllm", False),
                prefix_partition=Partition.from_dict(raw.get("prefix_partition")),
            )
        except (OSError, ValueError, AttributeError, TypeError) as exc:  # ValueError: bad JSON, or no such Staleness
            log.warning("state file %s unreadable (%r): weights treated as stale", self._path, exc)
            return UNREADABLE
        if not _well_formed(memo):
            log.warning("state file %s malformed (%s): weights treated as stale", self._path, memo)
            return UNREADABLE
        self._saved = memo
        return memo

    def save(self, memo: Memo) -> None:
        if self._path is None or memo == self._saved:
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(asdict(memo)))
            os.replace(tmp, self._path)
        except OSError as exc:
            log.error("could not write the state file %s: %r", self._path, exc, extra={"event": "memo_failed"})
            return
        self._saved = memo


def _well_formed(memo: Memo) -> bool:
    return (
        isinstance(memo.user_pause, str | None)
        and isinstance(memo.sleep_unconfirmed, bool)
        and isinstance(memo.asleep_outside_vllm, bool)
        and all(tag in ALL_SLEEP_TAGS or tag == "scheduling" for tag in memo.asleep_tags)
        and (memo.sleep_level is None or (type(memo.sleep_level) is int and 0 <= memo.sleep_level <= 2))
    )
