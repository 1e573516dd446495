"""`InFlightRequests`: the inference requests sent to vLLM and not yet answered, each with a handle to end it.

After a level-2 sleep vLLM still runs a request that was on its way, on discarded weights: a 200 with garbage.
`abort_all` ends every such request before any wake is sent: its upstream connection is closed (vLLM aborts it) and
the client gets 503 `aborted_by_sleep`, or that error as an SSE event on a started stream. docs/design.md.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

log = logging.getLogger("lifeguard.inflight")


class Abortable(Protocol):
    def abort(self, message: str) -> bool:
        """End the request (its upstream connection closed, its client answered); False when there was
        nothing left to end."""
        ...


class InFlightRequests:
    def __init__(self) -> None:
        self._entries: set[Abortable] = set()
        # When vLLM last sent a byte of an answer, or requests went in flight after none was (lifecycle/stall.py).
        self.last_progress = time.monotonic()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Abortable) -> None:
        """A forwarded request; it calls `discard` when it ends."""
        if not self._entries:
            self.last_progress = time.monotonic()
        self._entries.add(entry)

    def progressed(self) -> None:
        """vLLM sent bytes of an answer."""
        self.last_progress = time.monotonic()

    def discard(self, entry: Abortable) -> None:
        self._entries.discard(entry)

    def abort_all(self, message: str) -> int:
        """End every request still waiting on vLLM; each one's upstream connection is closed on return."""
        aborted = [entry for entry in list(self._entries) if entry.abort(message)]
        if aborted:
            log.warning("ended %d forwarded requests: %s", len(aborted), message, extra={"event": "inflight_aborted"})
        return len(aborted)
