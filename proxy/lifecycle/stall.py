"""`StallWatch`: inference requests in flight and no byte from vLLM for `stall_after_s` while RUNNING.

Field reports (Tanguille/cluster #4593) tell of hours at 0 tokens/s with requests running while vLLM's `/health` says
200: nothing the flags or the health check show. The proxy relays every byte of every answer, so it sees it: the
front marks each read of an answer (`InFlightRequests.progressed`), and a loop of its own looks each reconcile interval
(reconcile.py's `stall_loop`: a reconcile round may wait on vLLM, and a stall holds that wait too). A stalled
engine is not ready (`/lifeguard/serving` 503 `stalled`, so routers send elsewhere), `lifeguard_engine_stalled` is 1
and a WARNING names it; the first bytes again clear it at the next round. Requests are not held for it: what would
release them is vLLM's own progress, which the proxy cannot cause.
"""

from __future__ import annotations

import logging
import time

from ..observe.metrics import EngineMetrics
from .inflight import InFlightRequests
from .record import EngineRecord
from .states import State

log = logging.getLogger("lifeguard.lifecycle")


class StallWatch:
    def __init__(
        self, after_s: float | None, inflight: InFlightRequests, record: EngineRecord, metrics: EngineMetrics
    ) -> None:
        self._after_s = after_s
        self._inflight = inflight
        self._record = record
        self._metrics = metrics

    def look(self) -> None:
        """One round: stalled, or not any more."""
        if self._after_s is None:
            return
        silent = time.monotonic() - self._inflight.last_progress
        stalled = self._record.state is State.RUNNING and len(self._inflight) > 0 and silent >= self._after_s
        was = self._record.stalled_for is not None
        if stalled and not was:
            log.warning(
                "engine %s stalled: %d requests in flight and no byte from vLLM for %.0f s (its /health may still "
                "say 200); not ready until bytes flow again",
                self._metrics.name,
                len(self._inflight),
                silent,
                extra={"event": "engine_stalled", "engine": self._metrics.name, "inflight": len(self._inflight)},
            )
        elif was and not stalled:
            log.warning("engine %s: no longer stalled", self._metrics.name,
                        extra={"event": "engine_stall_cleared", "engine": self._metrics.name})  # fmt: skip
        if stalled != was:
            self._metrics.stalled(stalled)
        self._record.stall_seen(silent if stalled else None)
