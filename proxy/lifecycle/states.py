"""The lifecycle state set and its transition table, as a plain synchronous `transitions.Machine`.

`begin_*` triggers are imperatives with strict sources; `settle_*` and `fail` are facts the coordinator adopts from
whatever state it was in, because the engine's truth wins. No callback does I/O; the coordinator is the only caller.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transitions import Machine


class State(enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    PAUSING = "PAUSING"
    PAUSED = "PAUSED"
    RESUMING = "RESUMING"
    FALLING_ASLEEP = "FALLING_ASLEEP"
    SLEEPING = "SLEEPING"
    WAKING = "WAKING"
    UPDATING_WEIGHTS = "UPDATING_WEIGHTS"
    # vLLM's elastic-EP gate is up while the deployment scales (proxy/upstream/elastic_ep.py): inference held.
    SCALING = "SCALING"
    # vLLM 0.34's process checkpoint (docs/design.md): drained and its KV cache released for a checkpoint of the
    # process, until a verified restore. Inference held; sleep, wake, resume and weight writes refused.
    PREPARING_CHECKPOINT = "PREPARING_CHECKPOINT"
    CHECKPOINTED = "CHECKPOINTED"
    RESTORING = "RESTORING"
    FAILED = "FAILED"


SETTLED = frozenset(
    {
        State.RUNNING,
        State.PAUSED,
        State.SLEEPING,
        State.UPDATING_WEIGHTS,
        State.SCALING,
        State.CHECKPOINTED,
        State.FAILED,
    }
)

_ANY = [s for s in State]
_SETTLE_FROM = [s for s in State if s is not State.FAILED]

TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "begin_pause", "source": State.RUNNING, "dest": State.PAUSING},
    {"trigger": "begin_resume", "source": State.PAUSED, "dest": State.RESUMING},
    {"trigger": "begin_sleep", "source": [State.RUNNING, State.PAUSED], "dest": State.FALLING_ASLEEP},
    # A sleep the GPUs could not confirm is sent again, not answered as a no-op (rules.EngineView).
    {"trigger": "begin_sleep_again", "source": State.SLEEPING, "dest": State.FALLING_ASLEEP},
    {"trigger": "begin_wake", "source": State.SLEEPING, "dest": State.WAKING},
    {
        "trigger": "begin_weight_update",
        "source": [State.RUNNING, State.PAUSED, State.SLEEPING],
        "dest": State.UPDATING_WEIGHTS,
    },
    {"trigger": "begin_checkpoint", "source": [State.RUNNING, State.PAUSED], "dest": State.PREPARING_CHECKPOINT},
    {"trigger": "begin_restore", "source": State.CHECKPOINTED, "dest": State.RESTORING},
    {"trigger": "settle_running", "source": _SETTLE_FROM, "dest": State.RUNNING},
    {"trigger": "settle_paused", "source": _SETTLE_FROM, "dest": State.PAUSED},
    {"trigger": "settle_sleeping", "source": _SETTLE_FROM, "dest": State.SLEEPING},
    {"trigger": "settle_updating", "source": _SETTLE_FROM, "dest": State.UPDATING_WEIGHTS},
    {"trigger": "settle_scaling", "source": _SETTLE_FROM, "dest": State.SCALING},
    {"trigger": "settle_checkpointed", "source": _SETTLE_FROM, "dest": State.CHECKPOINTED},
    {"trigger": "fail", "source": _ANY, "dest": State.FAILED},
    # A failed engine is only trusted again once it has been seen healthy from scratch.
    {"trigger": "engine_back", "source": State.FAILED, "dest": State.STARTING},
]


class Lifecycle:
    """The model the machine drives; `state` is always a `State`.

    The machine binds every trigger (and its own `is_<state>`, `may_<trigger>`, `trigger`) to the instance. The
    triggers are declared below for the type checker only, so a misspelt trigger is an error mypy reports; at run
    time the class defines none, so the machine has nothing to skip or to warn about. A trigger that is not valid
    from the current state raises `transitions.MachineError`."""

    state: State

    def __init__(self, on_change: Callable[[State, State], None]) -> None:
        self._on_change = on_change
        self.machine = Machine(
            model=self,
            states=State,
            transitions=TRANSITIONS,
            initial=State.STARTING,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=True,
            after_state_change=self._changed,
        )

    def _changed(self, event: Any) -> None:
        self._on_change(State[event.transition.source], self.state)

    if TYPE_CHECKING:
        # --- begin_*: an operation starts (strict sources)
        def begin_pause(self) -> bool: ...
        def begin_resume(self) -> bool: ...
        def begin_sleep(self) -> bool: ...
        def begin_sleep_again(self) -> bool: ...
        def begin_wake(self) -> bool: ...
        def begin_weight_update(self) -> bool: ...
        def begin_checkpoint(self) -> bool: ...
        def begin_restore(self) -> bool: ...

        # --- facts: what was verified or observed
        def settle_running(self) -> bool: ...
        def settle_paused(self) -> bool: ...
        def settle_sleeping(self) -> bool: ...
        def settle_updating(self) -> bool: ...
        def settle_scaling(self) -> bool: ...
        def settle_checkpointed(self) -> bool: ...
        def fail(self) -> bool: ...
        def engine_back(self) -> bool: ...
