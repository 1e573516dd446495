"""An inference request the gate holds, parked in its queue as parsed bytes (proxy/exchange.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .errors import LifeguardError
from .exchange import Answering, ClientSide, Upstreams
from .gate import Parked, RequestGate, Ticket
from .handlers import GATE_OUTCOMES
from .relays import FastExchange
from .request_reader import ParsedRequest

log_http = logging.getLogger("lifeguard.http")  # where the aiohttp handlers log a request not forwarded


class HeldExchange(Answering):
    """An inference request the gate holds (`RequestGate.park`): only its parsed bytes and callbacks wait.
    Admitted, it goes on as a `FastExchange` on the same client connection; refused (deadline, queue full,
    engine failed, shutdown), it is answered with the gate's error, as the aiohttp handler answered it."""

    __slots__ = ("_up", "_gate", "_target", "_stale", "_parked")

    def __init__(
        self,
        client: ClientSide,
        request: ParsedRequest,
        upstreams: Upstreams,
        gate: RequestGate,
        target: bytes,
        stale: Callable[[], bool],
    ) -> None:
        super().__init__(client, request)
        self._up = upstreams
        self._gate = gate
        self._target = target
        self._stale = stale
        self._parked: Parked | None = None

    def start(self) -> None:
        try:
            self._parked = self._gate.park(self, self.request.body_size)
        except LifeguardError as exc:
            self.refused(exc)

    def admitted(self, ticket: Ticket) -> None:
        self._parked = None
        self.finished = True
        fast = FastExchange(self.client, self.request, self._up, ticket, self._target, stale=self._stale())
        self.client.replace_exchange(self, fast)
        fast.start()

    def refused(self, error: LifeguardError) -> None:
        self._parked = None
        self._not_forwarded(error.reason if error.reason in GATE_OUTCOMES else "engine_unavailable")
        self._answer_error(error)
        self.finished = True
        self.client.exchange_done(self, close=self.close_client)

    def client_writable(self, writable: bool) -> None:
        return None  # nothing is sent to the client while it waits

    def client_gone(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None and not self.finished:
            parked.cancel()
            self._not_forwarded("client_gone")
        self.finished = True

    def _not_forwarded(self, outcome: str) -> None:
        request = self.request
        held_s = time.monotonic() - request.started
        metrics = self._up.metrics
        metrics.inference_finished(outcome)
        metrics.request_duration("inference", held_s)
        request_id = next((value for name, value in request.headers if name.lower() == b"x-request-id"), None)
        log_http.info(
            "request not forwarded: %s",
            outcome,
            extra={
                "event": "hold_ended",
                "reason": outcome,
                "path": request.url.split(b"?", 1)[0].decode("latin-1"),
                "held_s": round(held_s, 4),
                "request_id": request_id.decode("latin-1") if request_id is not None else None,
            },
        )
