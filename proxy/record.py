"""`EngineRecord`: what we hold to be true about the engine, and how observations change it.

Sans-IO: the coordinator does the talking to vLLM and hands observations in; this module keeps the
state machine and the facts beside it (sleep level, tags still asleep, the user's pause, the weight
update session, stale weights, last error, history), and decides what an observation means. It is
synchronous throughout, so each change is atomic on the event loop.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from .metrics import Metrics
from .rules import EngineView, asleep_tags_for
from .states import Lifecycle, State
from .upstream import Observation

log = logging.getLogger("lifeguard.lifecycle")

_SETTLE_TRIGGER = {
    State.RUNNING: "settle_running",
    State.PAUSED: "settle_paused",
    State.SLEEPING: "settle_sleeping",
    State.UPDATING_WEIGHTS: "settle_updating",
}


class EngineRecord:
    def __init__(
        self,
        metrics: Metrics,
        on_view_change: Callable[[], None],
        on_weights_changed: Callable[[], None] = lambda: None,
        on_weights_discarded: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_weights_changed`: the engine's weights are not the ones they were (loaded, discarded, or the
        initial checkpoint of a restarted engine); answers recorded from the old ones no longer apply.
        `on_weights_discarded`: vLLM holds no valid weights (a level-2 sleep): what it queued must not run."""
        self._metrics = metrics
        self._on_view_change = on_view_change
        self._on_weights_changed = on_weights_changed
        self._on_weights_discarded = on_weights_discarded
        self.sleep_level: int | None = None
        self.asleep_tags: frozenset[str] = frozenset()
        self.sleep_unconfirmed = False
        self.user_pause: str | None = None
        self.weight_update_active = False
        self.return_state = State.RUNNING
        # "discarded" after a level-2 sleep, "restarted" after an engine restart; None when valid.
        self.weights_stale: str | None = None
        self.failure_kind: str | None = None
        self.last_error: dict[str, Any] | None = None
        self.since = time.time()
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self.drift_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._ever_running = False
        self.lifecycle = Lifecycle(self._on_state_change)

    @property
    def state(self) -> State:
        return self.lifecycle.state

    def view(self) -> EngineView:
        return EngineView(
            self.state,
            self.sleep_level,
            self.asleep_tags,
            self.user_pause,
            self.weight_update_active,
            self.weights_stale,
            self.sleep_unconfirmed,
        )

    def fire(self, trigger: str) -> None:
        self.lifecycle.fire(trigger)

    # ----- facts the coordinator establishes
    def fell_asleep(self, level: int, *, confirmed: bool = True) -> None:
        self.sleep_level = level
        self.asleep_tags = asleep_tags_for(level)
        self.sleep_unconfirmed = not confirmed
        if level == 2:
            self.discarded()

    def discarded(self) -> None:
        """vLLM's weights are gone (a level-2 sleep, seen or adopted) until they are loaded again."""
        self._on_weights_discarded()
        if self.weights_stale != "discarded":
            self.mark_stale("discarded")

    def mark_stale(self, reason: str) -> None:
        self.weights_stale = reason
        self._metrics.weights_stale(True)
        self._on_weights_changed()
        self._on_view_change()

    def weights_loaded(self) -> None:
        self._on_weights_changed()
        if self.weights_stale is not None:
            self.weights_stale = None
            self._metrics.weights_stale(False)
            self._on_view_change()

    def error(self, reason: str, message: str) -> None:
        self.last_error = {"reason": reason, "message": message, "at": time.time()}

    def set_failed(self, kind: str, message: str) -> None:
        self.failure_kind = kind
        self.error("engine_" + kind, message)
        if self.state is not State.FAILED:
            self.fire("fail")

    def settle(self, state: State) -> None:
        if self.state is State.FAILED:
            self.fire("engine_back")
        if self.state is not state:
            self.fire(_SETTLE_TRIGGER[state])

    # ----- adopting what the engine really is
    def adopt(
        self, obs: Observation, *, hint: State, message: str | None = None, memory_freed: bool | None = None
    ) -> None:
        """Set our state from vLLM's flags. They cannot tell a pause from a sleep, so `hint` says which
        of the two we were near (the operation that just failed, or the state we believed).
        `memory_freed`: whether the GPUs show the sleep's memory gone (None: cannot tell)."""
        if not obs.reachable or not obs.healthy:
            self.set_failed("unreachable", message or obs.error or "/health is not 200")
            return
        if obs.sleeping is False and not obs.paused:
            self.asleep_tags, self.sleep_level, self.user_pause = frozenset(), None, None
            self.settle(State.UPDATING_WEIGHTS if self.weight_update_active else State.RUNNING)
        elif (level := _gauge_sleep_level(obs, memory_freed)) is not None:
            if self.sleep_level != level or not self.asleep_tags:
                self.sleep_level = level
                self.asleep_tags = asleep_tags_for(level)
            if level == 2:  # a level-2 sleep we did not make (or whose answer we lost): same as our own
                self.discarded()
            self.settle(State.SLEEPING)
        elif hint is State.UPDATING_WEIGHTS:
            self.settle(State.UPDATING_WEIGHTS)
        elif hint in (State.PAUSED, State.RUNNING, State.PAUSING, State.RESUMING) or obs.metric_awake:
            # Older vLLM set the gauge awake after a partial wake too: "awake" only overrides a non-sleep hint.
            if hint in (State.SLEEPING, State.WAKING, State.FALLING_ASLEEP) and self.asleep_tags:
                self.settle(State.SLEEPING)
                return
            self.user_pause = self.user_pause or "abort"
            self.asleep_tags, self.sleep_level = frozenset(), None
            self.settle(State.PAUSED)
        else:
            if not self.asleep_tags:
                # Asleep at a level neither our record nor vLLM's gauge tells: the weights may be discarded.
                self.sleep_level = self.sleep_level if self.sleep_level is not None else 1
                self.asleep_tags = asleep_tags_for(self.sleep_level)
                self.discarded()
            self.settle(State.SLEEPING)

    def reconcile_with(self, obs: Observation, *, memory_freed: bool | None = None) -> None:
        """One round of the reconcile loop: engine lost, engine back, or drift."""
        state = self.state
        if not obs.reachable or not obs.healthy:
            if state is State.STARTING:
                # A sidecar starts before vLLM has loaded its model: not a failure, requests are held.
                self.error("engine_starting", obs.error or "/health is not 200 yet")
            elif state is not State.FAILED:
                self.set_failed("unreachable", obs.error or "/health is not 200")
            else:
                self.failure_kind = "unreachable"
            return
        if state is State.FAILED:
            if self.failure_kind != "unreachable":
                return  # healthy but broken (garbage, memory not back): only a restart brings it back
            self.fire("engine_back")
            if self._ever_running:
                self._restarted()
            state = State.STARTING
        if state is State.STARTING:
            self.adopt(obs, hint=State.STARTING if obs.paused else State.RUNNING, memory_freed=memory_freed)
            return
        if state is State.UPDATING_WEIGHTS:
            return
        expected = (False, False) if state is State.RUNNING else (True, True)
        seen = (obs.sleeping, obs.paused if obs.paused is not None else obs.sleeping)
        # The flags cannot tell a sleep from a pause; vLLM's sleep-state gauge can, one way round.
        slept_while_paused = state is State.PAUSED and _gauge_sleep_level(obs, memory_freed) is not None
        if seen != expected or slept_while_paused:
            before = state.value
            self.adopt(obs, hint=state, memory_freed=memory_freed)
            event = {"at": time.time(), "before": before, "after": self.state.value, "observed": list(seen)}
            self.drift_events.append(event)
            self._metrics.drift()
            log.warning("drift: vLLM's flags disagree with our state", extra={"event": "drift", **event})

    def healed(self, obs: Observation) -> None:
        """The check that failed (garbage, memory not back) passes again on an engine that never went away."""
        log.warning("the failed check passes again; engine trusted again", extra={"event": "engine_healed"})
        self.adopt(obs, hint=State.RUNNING)

    def restarted_unseen(self, why: str) -> None:
        """vLLM restarted between two reconcile rounds; only something it said gave it away."""
        self.error("engine_restarted", why)
        self._restarted()

    def _restarted(self) -> None:
        """A restarted vLLM holds its initial checkpoint, not the trained weights."""
        self._metrics.engine_restart()
        self.weight_update_active = False
        self.user_pause = None
        self.asleep_tags, self.sleep_level = frozenset(), None
        self.mark_stale("restarted")
        log.warning("engine restarted; weights marked stale", extra={"event": "engine_restart"})

    # ----- state changes
    def _on_state_change(self, src: State, dst: State) -> None:
        if src is dst:
            return
        self.since = time.time()
        if dst not in (State.FALLING_ASLEEP, State.SLEEPING, State.WAKING, State.UPDATING_WEIGHTS):
            self.sleep_unconfirmed = False
        if dst is State.RUNNING:
            self._ever_running = True
        if src is State.FAILED:
            self.failure_kind = None
        self.history.append({"from": src.value, "to": dst.value, "at": self.since})
        self._metrics.state_changed(src.value, dst.value)
        log.info("state %s -> %s", src.value, dst.value,
                 extra={"event": "state_change", "from_state": src.value, "to_state": dst.value})  # fmt: skip
        self._on_view_change()

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "since": self.since,
            "sleep_level": self.sleep_level,
            "asleep_tags": sorted(self.asleep_tags),
            "sleep_unconfirmed": self.sleep_unconfirmed,
            "paused": self.user_pause is not None or self.state in (State.PAUSED, State.PAUSING),
            "pause_mode": self.user_pause,
            "weight_update_active": self.weight_update_active,
            "weights_stale": self.weights_stale is not None,
            "weights_stale_reason": self.weights_stale,
            "last_error": self.last_error,
            "transitions": list(self.history),
            "drift_events": list(self.drift_events),
        }


def _gauge_sleep_level(obs: Observation, memory_freed: bool | None) -> int | None:
    """The level vLLM's sleep-state gauge says, unless the GPUs contradict it. The gauge is only written by /sleep and
    /wake_up, so a sleep that answered 200 without sleeping leaves it saying "asleep" through later pauses
    (chaos run, lie-asleep then /pause): a paused engine taken for a sleeping one gets its /sleep no-op'd."""
    level = obs.metric_level
    if obs.metric_awake is not False or level is None:
        return None
    return level if level == 0 or memory_freed is not False else None
