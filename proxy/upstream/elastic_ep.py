"""Elastic EP as the proxy reads it: the middleware's gate, `/is_scaling_elastic_ep`, and what they mean together.

Sans-IO. vLLM's elastic-EP middleware answers 503 `{"error": "<string>"}` to every request while scaling and for
good on a retired rank, and its `/health` is no witness. A gated answer makes the proxy read
`/is_scaling_elastic_ep` and decide from status and shape: SCALING (inference held), FAILED (phase "failed") or
RETIRED (gated with no scale in progress, read twice). docs/design.md.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

SCALING_PHASES = frozenset({"preparing", "committing"})


class ElasticVerdict(enum.StrEnum):
    SCALING = "scaling"
    RETIRED = "retired"
    FAILED = "failed"


@dataclass(frozen=True)
class ElasticStatus:
    """What `/is_scaling_elastic_ep` said; `problem` says why it could not be read (then nothing else is known)."""

    scaling: bool | None = None
    phase: str | None = None
    epoch: int | None = None
    error: str | None = None
    requested_size: int | None = None
    problem: str | None = None

    @property
    def verdict(self) -> ElasticVerdict:
        if self.problem is not None or self.scaling or self.phase in SCALING_PHASES:
            return ElasticVerdict.SCALING
        if self.phase == "failed":
            return ElasticVerdict.FAILED
        return ElasticVerdict.RETIRED

    def describe(self) -> str:
        """For people: the state's reason in /lifeguard/state and the errors the proxy answers."""
        if self.problem is not None:
            return f"vLLM's elastic EP gate is up and its status cannot be read ({self.problem}): treated as scaling"
        epoch = f", epoch {self.epoch}" if self.epoch is not None else ""
        size = f" to {self.requested_size} data-parallel ranks" if self.requested_size is not None else ""
        if self.verdict is ElasticVerdict.SCALING:
            return f"vLLM is scaling elastic EP{size} (phase {self.phase or 'unknown'}{epoch})"
        if self.verdict is ElasticVerdict.FAILED:
            return f"vLLM's elastic EP scale{size} failed (epoch {self.epoch}): {self.error or 'no error given'}"
        return "this data-parallel rank was retired by an elastic EP scale-down and awaits shutdown"

    def as_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value,
            "phase": self.phase,
            "epoch": self.epoch,
            "error": self.error,
            "requested_data_parallel_size": self.requested_size,
            "problem": self.problem,
        }


def gate_message(status: int, body: bytes) -> str | None:
    """The middleware's message when this answer is its 503 (`{"error": "<string>"}`, nothing else), else None."""
    if status != 503:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], str):
        return str(payload["error"])
    return None


def parse_status(status: int, body: bytes) -> ElasticStatus:
    """`/is_scaling_elastic_ep`'s answer; anything but a 200 with a boolean `is_scaling_elastic_ep` is unreadable."""
    if status != 200:
        gated = gate_message(status, body)
        return ElasticStatus(problem=f"status {status}" + (" (the route is gated too: vLLM 0.32)" if gated else ""))
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ElasticStatus(problem="the body is not JSON")
    if not isinstance(payload, dict) or not isinstance(payload.get("is_scaling_elastic_ep"), bool):
        return ElasticStatus(problem="no boolean is_scaling_elastic_ep in the body")
    phase, epoch, error, size = (payload.get(k) for k in ("phase", "epoch", "error", "requested_data_parallel_size"))
    return ElasticStatus(
        scaling=payload["is_scaling_elastic_ep"],
        phase=phase if isinstance(phase, str) else None,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        error=error if isinstance(error, str) else None,
        requested_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
    )
