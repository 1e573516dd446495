"""An inference request the gate holds, parked in its queue as the bytes it came with (proxy/front/exchange.py)."""

from __future__ import annotations

import logging
import time

from ..errors import LifeguardError
from ..lifecycle.engine import Engine
from ..lifecycle.gate import Parked, Ticket
from .boundary import caught
from .exchange import Answering, ClientSide, Forward
from .request_reader import ParsedRequest

log = logging.getLogger("lifeguard.http")

#: How a request the gate refused ended, as `lifeguard_inference_requests_total` counts it.
GATE_OUTCOMES = frozenset(
    {
        "hold_timeout",
        "hold_queue_full",
        "shutting_down",
        "engine_unavailable",
        "engine_sleeping",
        "insufficient_gpu_memory",
    }
)


class HeldExchange(Answering):
    """An inference request the gate holds (`RequestGate.park`): only its parsed bytes and callbacks wait.
    Admitted, it goes on as a `Forward` on the same client connection; refused (deadline, queue full,
    engine failed, shutdown), it is answered with the gate's error."""

    __slots__ = ("_engine", "_target", "_parked")

    def __init__(self, client: ClientSide, request: ParsedRequest, engine: Engine, target: bytes) -> None:
        super().__init__(client, request)
        self._engine = engine
        self._target = target
        self._parked: Parked | None = None

    def start(self) -> None:
        self.request.compact()
        try:
            self._parked = self._engine.hold(self, self.request.body_size)
        except LifeguardError as exc:
            self.refused(exc)

    def admitted(self, ticket: Ticket) -> None:
        self._parked = None
        self.finished = True
        try:
            forward = Forward(self.client, self.request, self._engine, self._target, ticket=ticket,
                              stale=self._engine.weights_stale)  # fmt: skip
            self.client.replace_exchange(self, forward)
            forward.start()
        except Exception as exc:
            ticket.done()
            self._end(caught("hold", exc, self._engine.metrics.proxy_error), "proxy_error")

    def refused(self, error: LifeguardError) -> None:
        self._parked = None
        try:
            self._end(error, error.reason if error.reason in GATE_OUTCOMES else "engine_unavailable")
        except Exception as exc:
            self.close_client = True
            self.client.transport.abort()
            caught("hold", exc, self._engine.metrics.proxy_error)

    def client_writable(self, writable: bool) -> None:
        return None  # nothing is sent to the client while it waits

    def client_gone(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None and not self.finished:
            parked.cancel()
            not_forwarded(self._engine, self.request, "client_gone")
        self.finished = True

    def _end(self, error: LifeguardError, outcome: str) -> None:
        not_forwarded(self._engine, self.request, outcome)
        self._answer_error(error)
        self.finished = True
        self.client.exchange_done(self, close=self.close_client)


def not_forwarded(engine: Engine, request: ParsedRequest, outcome: str) -> None:
    """An inference request that ends without reaching vLLM: counted and logged, once."""
    held_s = time.monotonic() - request.started
    engine.metrics.inference_finished(outcome, held_s)
    request_id = next((value for name, value in request.headers if name.lower() == b"x-request-id"), None)
    log.info(
        "request not forwarded: %s",
        outcome,
        extra={
            "event": "hold_ended",
            "engine": engine.name,
            "reason": outcome,
            "path": request.url.split(b"?", 1)[0].decode("latin-1"),
            "held_s": round(held_s, 4),
            "request_id": request_id.decode("latin-1") if request_id is not None else None,
        },
    )
