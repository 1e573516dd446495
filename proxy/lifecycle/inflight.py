"""`InFlightRequests`: the inference requests the proxy has sent to vLLM and not yet seen answered, each
with a handle to end it.

Why: after a level-2 sleep vLLM holds no valid weights, yet it still queues a request that was on its way
when the sleep began (or frozen by `mode=keep`) and runs it right after the wake, on discarded weights:
a 200 with garbage. The proxy knows every such request, so it ends them once the weights are gone, before
any wake is sent: the upstream connection is closed (vLLM aborts a request whose client went away) and
the client gets 503 `aborted_by_sleep`, or, on a stream that already started, the same error as an SSE
event and then the end of the stream. `abort_all` is the entry point for any call after which the weights
vLLM holds are not those a queued request was sent for (a level-2 sleep today). An entry (a forwarded
request of proxy/front/exchange.py) ends itself synchronously in `abort`: its upstream connection is closed
before `abort` returns.
"""

from __future__ import annotations

import logging
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

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Abortable) -> None:
        """A forwarded request; it calls `discard` when it ends."""
        self._entries.add(entry)

    def discard(self, entry: Abortable) -> None:
        self._entries.discard(entry)

    def abort_all(self, message: str) -> int:
        """End every request still waiting on vLLM; each one's upstream connection is closed on return."""
        aborted = [entry for entry in list(self._entries) if entry.abort(message)]
        if aborted:
            log.warning("ended %d forwarded requests: %s", len(aborted), message, extra={"event": "inflight_aborted"})
        return len(aborted)
