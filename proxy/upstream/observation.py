"""`Observation`: what vLLM's flags, sleep-state gauge and elastic-EP gate said in one round, and the gauge's parser.

Sans-IO: the HTTP client (vllm_client.py) reads these; the record (lifecycle/record.py) and the verifier
decide what they mean without importing any HTTP library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .elastic_ep import ElasticStatus

_SLEEP_STATE = re.compile(rb'^vllm:engine_sleep_state\{[^}]*sleep_state="(\w+)"[^}]*\} ([0-9.eE+-]+)', re.M)


def parse_sleep_state(metrics_text: bytes) -> tuple[bool | None, int | None]:
    """(awake, level) from vLLM's `vllm:engine_sleep_state` gauge; (None, None) when absent.

    The gauge reads awake after any wake call, partial ones included, so `awake` only means "not
    asleep by the last sleep/wake call vLLM recorded"."""
    values = {name.decode(): float(value) for name, value in _SLEEP_STATE.findall(metrics_text)}
    if not values:
        return None, None
    if values.get("awake", 0) >= 1:
        return True, None
    if values.get("discard_all", 0) >= 1:
        return False, 2
    if values.get("weights_offloaded", 0) >= 1:
        return False, 1
    return False, 0


@dataclass(frozen=True)
class Observation:
    """vLLM's flags as read in one round: `reachable` False means refused/reset/timed out; `timed_out`
    tells the last apart: an API server short of CPU answers late, a dead one refuses or says 503."""

    reachable: bool
    timed_out: bool = False
    healthy: bool = False
    sleeping: bool | None = None
    paused: bool | None = None
    error: str | None = None
    # Why it could not be reached, in words (refused, DNS, TLS, no answer in time), without the call that failed.
    why: str | None = None
    # From vllm:engine_sleep_state: the sleep level vLLM last recorded, 0 for awake... or None when
    # unknown. It tells a sleep from a mere pause, which the two flags cannot (both are true in both).
    metric_level: int | None = None
    metric_awake: bool | None = None
    # Set when vLLM's elastic-EP gate answered the flag reads (elastic_ep.py): the flags are unknown then, and
    # what vLLM is doing is what /is_scaling_elastic_ep said. `healthy` is no witness in that case.
    elastic: ElasticStatus | None = None
    # vLLM 0.34's checkpoint state (`GET /checkpoint/status`: "preparing", "prepared", "restoring", "failed" or
    # "running"), read only while the flags say paused or asleep, as a prepared engine's do; None: not read, or not
    # served (vLLM before 0.34, or without sleep mode).
    checkpoint: str | None = None
    checkpoint_error: str | None = None


class LateReads:
    """The one rule for reads vLLM answered too late (`Observation.timed_out`): an API server short of CPU,
    relaying a long stream, answered /is_sleeping after more than 10 s on real vLLM (docs/real-vllm.md). Such a
    read is passed over until `limit` of them come in a row; a refused connection or a 503 counts at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def pass_over(self, obs: Observation) -> bool:
        """True: take no conclusion from `obs`, it was late and the run of late reads is still short."""
        if not obs.timed_out:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            self.in_a_row = 0
            return False
        return True
