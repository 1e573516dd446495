"""Policies that start lifecycle calls on their own, through the coordinator's serialized, verified path.

* wake on request (`on_sleeping: wake`): arriving requests make one wake (identical calls coalesce), never onto
  weights a level-2 sleep discarded unless the arbiter reloads them (`swap_sleep_level: 2`);
* idle auto-sleep (`idle_sleep_after_s`): nothing in flight or held for that long puts the engine to sleep.
"""

from __future__ import annotations

import logging

from ..config import Settings
from ..errors import LifeguardError
from ..observe.metrics import EngineMetrics
from .calls import LifecycleCall
from .coordinator import LifecycleCoordinator
from .gate import RequestGate
from .rules import Staleness
from .states import State

log = logging.getLogger("lifeguard.policy")


class Policies:
    def __init__(
        self, settings: Settings, coordinator: LifecycleCoordinator, gate: RequestGate, metrics: EngineMetrics
    ) -> None:
        self._settings = settings
        self._coordinator = coordinator
        self._gate = gate
        self._metrics = metrics

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
            log.warning("policy %s failed: %s", call.op, exc.message, extra={"event": "policy", "reason": exc.reason})
