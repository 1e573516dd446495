"""`Reachability`: whether vLLM answers at all, said where an operator looks. A wrong or down `upstream` is a
WARNING at the first reconcile round that cannot reach it (its URL, the reason in words: refused, DNS, TLS, no answer
in time), again every `REPEAT_S` while it stays so, and one line when it answers; /lifeguard/state, the readiness
answers and the engine's errors carry the same sentence. Sans-IO but for the log lines, like the record that owns it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..upstream.observation import Observation

log = logging.getLogger("lifeguard.reconcile")

#: Seconds between two WARNING lines while vLLM stays unreachable (a sidecar's vLLM loads for minutes).
REPEAT_S = 30.0


class Reachability:
    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        """`url`: vLLM's base URL as it may be shown (no password)."""
        self.url = url
        self._clock = clock
        self.why: str | None = None  # how the last round failed to reach it; None while it answers
        self.since: float | None = None  # wall-clock time of the first round in a row that could not reach it
        self._started: float = 0.0
        self._said_at: float | None = None

    @property
    def sentence(self) -> str | None:
        """What an operator reads while vLLM cannot be reached; None while it answers."""
        return None if self.why is None else f"vLLM at {self.url} cannot be reached: {self.why}"

    def observed(self, obs: Observation) -> None:
        """One reconcile round's reading: any HTTP answer (a 503 too) is reaching it."""
        now = self._clock()
        if obs.reachable:
            if self.why is not None:
                log.info("vLLM at %s answers again, after %.1f s unreachable", self.url, now - self._started,
                         extra={"event": "upstream_reachable", "url": self.url})  # fmt: skip
            self.why = self.since = self._said_at = None
            return
        if self.why is None:
            self.since, self._started = time.time(), now
        self.why = obs.why or obs.error or "no answer"
        if self._said_at is None or now - self._said_at >= REPEAT_S:
            self._said_at = now
            log.warning("%s (said again every %g s until it answers)", self.sentence, REPEAT_S,
                        extra={"event": "upstream_unreachable", "url": self.url, "why": self.why,
                               "for_s": round(now - self._started, 1)})  # fmt: skip

    def snapshot(self) -> dict[str, Any] | None:
        return None if self.why is None else {"message": self.sentence, "since": self.since}
