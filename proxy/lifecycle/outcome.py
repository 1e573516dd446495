"""`Outcome`: what the client of a lifecycle call gets when it did not fail, as the coordinator decided it.

No HTTP here: handlers turn an outcome into a response and its `X-Lifeguard-*` headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..upstream.vllm_client import Reply
from .verdict import Verdict


@dataclass(frozen=True)
class Outcome:
    """What the client of a lifecycle call gets when it did not fail: vLLM's reply (or ours, for a call
    answered without vLLM) and what the coordinator decided; handlers turn it into HTTP."""

    status: int
    body: bytes
    content_type: str | None
    verdict: Verdict | None = None
    noop: bool = False  # answered by us: the engine is already where the call asks
    deferred: bool = False  # accepted without vLLM: a /pause while asleep, applied on the wake
    drained: str | None = None  # drain_before_sleep: "complete", or how many in flight were aborted
    pause_kept: str | None = None  # the user's pause mode, re-applied after vLLM's wake lifted it

    @property
    def label(self) -> str:
        """The `outcome` label of lifeguard_lifecycle_operations_total."""
        return "noop" if self.noop else "ok"


def answered_by_us(body: dict[str, Any], *, noop: bool = False, deferred: bool = False) -> Outcome:
    return Outcome(200, json.dumps(body).encode(), "application/json", noop=noop, deferred=deferred)


def from_vllm(reply: Reply, verdict: Verdict | None, **extra: Any) -> Outcome:
    return Outcome(reply.status, reply.body, reply.content_type, verdict, **extra)
