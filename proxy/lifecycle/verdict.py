"""What the verifier found after a lifecycle 200 (`Verdict`: its checks, each named, with its result), as values:
the outcome, the record and the checksums read it; the verifier (verifier.py) makes it. Sans-IO."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..gpu.readers import GpuReading
from ..upstream.observation import Observation


class CheckName(enum.StrEnum):
    HEALTH = "health"
    FLAGS = "flags"
    MEMORY = "memory"
    CANARY = "canary"
    LORA = "lora"
    WEIGHTS = "weights"  # vLLM's weight checksums (proxy/lifecycle/weight_checksums.py)
    # vLLM 0.34's process checkpoint (proxy/lifecycle/checkpoint_operations.py): its state, and vLLM's snapshot check
    CHECKPOINT = "checkpoint"
    SNAPSHOT = "snapshot"


class CheckResult(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Check:
    name: CheckName
    result: CheckResult
    detail: str
    value: Any = None


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    observation: Observation | None = None
    memory: GpuReading | None = None
    at: float = field(default_factory=time.time)
    seconds: float = 0.0

    def summary(self) -> str:
        """`name=result` per check, as sent in `X-Lifeguard-Verified`."""
        return ",".join(f"{c.name}={c.result}" for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if c.result is CheckResult.FAIL), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.failed is None,
            "at": self.at,
            "seconds": round(self.seconds, 4),
            "checks": [_json_safe(c.__dict__) for c in self.checks],
        }


def _json_safe(value: Any) -> Any:
    """NaN and infinities (a garbage canary's logprob) are not JSON; /lifeguard/state must stay parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
