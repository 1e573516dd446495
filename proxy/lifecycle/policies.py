"""Policies that start lifecycle calls on their own, through the coordinator's serialized, verified path.

* wake on request (`on_sleeping: wake`): arriving requests make one wake (identical calls coalesce), never onto
  weights a level-2 sleep discarded unless the arbiter reloads them (`swap_sleep_level: 2`);
* idle auto-sleep (`idle_sleep_after_s`): nothing in flight or held for that long puts the engine to sleep.
"""

from __future__ import annotations

import logging
import time

from ..config import Settings
from ..errors import LifeguardError
from ..observe.metrics import EngineMetrics
from .coordinator import LifecycleCoordinator
from .gate import RequestGate
from .parsed_calls import LifecycleCall
from .rules import Staleness
from .states import State

log = logging.getLogger("lifeguard.policy")
_REPEAT_LOG_S = 30.0


class Policies:
    def __init__(
        self, settings: Settings, coordinator: LifecycleCoordinator, gate: RequestGate, metrics: EngineMetrics
    ) -> None:
        self._settings = settings
        self._coordinator = coordinator
        self._gate = gate
        self._metrics = metrics
        self._last_failure: tuple[str, str] | None = None
        self._logged_at = 0.0
        self._left_out = 0

    def request_held_while_sleeping(self) -> None:
        if self._settings.on_sleeping != "wake":
            return
        view = self._coordinator.record.view()
        if view.state is not State.SLEEPING:
            return
        guard = self._coordinator.guard
        if view.weights_stale is Staleness.DISCARDED and not (guard is not None and guard.reloads_discarded_weights):
            return
        self._metrics.policy_action("wake_on_request")
        self._coordinator.tasks.spawn(self._run(LifecycleCall("wake_up")), name="policy:wake_on_request")

    def tick(self, now: float) -> None:
        """Called by the reconcile loop each round."""
        after = self._settings.idle_sleep_after_s
        if after is None or self._coordinator.state is not State.RUNNING or self._coordinator.busy:
            return
        if self._gate.inflight or self._gate.held or now - self._gate.last_activity < after:
            return
        level = self._settings.idle_sleep_level
        self._metrics.policy_action("idle_sleep")
        call = LifecycleCall("sleep", (("level", str(level)), ("mode", "abort")), level=level, mode="abort")
        self._coordinator.tasks.spawn(self._run(call), name="policy:idle_sleep")

    async def _run(self, call: LifecycleCall) -> None:
        try:
            await self._coordinator.submit(call)
        except LifeguardError as exc:
            self._failed(call.op, exc)
        else:
            self._last_failure = None

    def _failed(self, op: str, exc: LifeguardError) -> None:
        """Each held request of a sleeping engine asks for the wake again: the same refusal is one log line per
        _REPEAT_LOG_S, with how many were left out, not one per request."""
        now = time.monotonic()
        if self._last_failure == (op, exc.reason) and now - self._logged_at < _REPEAT_LOG_S:
            self._left_out += 1
            return
        more = f" ({self._left_out} more like it in the last {now - self._logged_at:.0f} s)" if self._left_out else ""
        log.warning("policy %s failed: %s%s", op, exc.message, more, extra={"event": "policy", "reason": exc.reason})
        self._last_failure, self._logged_at, self._left_out = (op, exc.reason), now, 0
