"""The pure state machine: which edges exist, which do not, and the change hook."""

import pytest
from transitions import MachineError

from proxy.lifecycle.states import SETTLED, Lifecycle, State


def machine() -> tuple[Lifecycle, list[tuple[State, State]]]:
    changes: list[tuple[State, State]] = []
    return Lifecycle(lambda src, dst: changes.append((src, dst))), changes


def test_the_machine_starts_in_starting_and_reports_every_change() -> None:
    lifecycle, changes = machine()
    assert lifecycle.state is State.STARTING
    lifecycle.settle_running()
    lifecycle.begin_sleep()
    assert changes == [(State.STARTING, State.RUNNING), (State.RUNNING, State.FALLING_ASLEEP)]


@pytest.mark.parametrize(
    ("start", "trigger"),
    [
        ("settle_running", "begin_wake"),
        ("settle_running", "begin_resume"),
        ("settle_paused", "begin_pause"),
        ("settle_sleeping", "begin_sleep"),
        ("settle_sleeping", "begin_pause"),
    ],
)
def test_an_operation_cannot_begin_from_a_state_it_does_not_apply_to(start: str, trigger: str) -> None:
    lifecycle, _ = machine()
    getattr(lifecycle, start)()
    with pytest.raises(MachineError):
        getattr(lifecycle, trigger)()


def test_a_failed_engine_must_be_seen_again_before_it_can_settle() -> None:
    lifecycle, _ = machine()
    lifecycle.settle_running()
    lifecycle.fail()
    with pytest.raises(MachineError):
        lifecycle.settle_running()
    lifecycle.engine_back()
    lifecycle.settle_running()
    assert lifecycle.state is State.RUNNING


def test_the_settled_states_are_those_a_call_ends_in() -> None:
    # SCALING: no call of ours ends there, but it lasts as long as vLLM's elastic-EP gate is up.
    assert SETTLED == {
        State.RUNNING,
        State.PAUSED,
        State.SLEEPING,
        State.UPDATING_WEIGHTS,
        State.SCALING,
        State.CHECKPOINTED,
        State.FAILED,
    }
    assert State.WAKING not in SETTLED


def test_a_checkpoint_is_prepared_from_an_awake_engine_only_and_restored_from_checkpointed_only() -> None:
    lifecycle, _ = machine()
    lifecycle.settle_sleeping()
    with pytest.raises(MachineError):
        lifecycle.begin_checkpoint()  # vLLM refuses to prepare an engine that sleeps
    lifecycle.settle_paused()
    lifecycle.begin_checkpoint()
    assert lifecycle.state is State.PREPARING_CHECKPOINT
    with pytest.raises(MachineError):
        lifecycle.begin_restore()
    lifecycle.settle_checkpointed()
    lifecycle.begin_restore()
    assert lifecycle.state is State.RESTORING


def test_scaling_is_entered_from_any_state_but_failed_and_left_by_settling() -> None:
    lifecycle, changes = machine()
    lifecycle.settle_sleeping()
    lifecycle.settle_scaling()
    assert lifecycle.state is State.SCALING
    lifecycle.settle_running()
    lifecycle.fail()
    with pytest.raises(MachineError):
        lifecycle.settle_scaling()  # from FAILED only through engine_back, as for every settle
    lifecycle.engine_back()
    lifecycle.settle_scaling()
    assert lifecycle.state is State.SCALING


def test_every_trigger_has_a_typed_method_and_every_method_a_trigger() -> None:
    """The declarations mypy reads (under TYPE_CHECKING in class Lifecycle) are exactly the machine's triggers, and
    each is bound on a model at run time."""
    import ast
    import inspect

    from proxy.lifecycle import states

    (lifecycle,) = (n for n in ast.parse(inspect.getsource(states)).body if getattr(n, "name", "") == "Lifecycle")
    (typed,) = (n for n in ast.walk(lifecycle) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = {n.name for n in typed.body if isinstance(n, ast.FunctionDef)}
    triggers = {t["trigger"] for t in states.TRANSITIONS}
    assert declared == triggers
    model = Lifecycle(lambda _src, _dst: None)
    assert all(callable(getattr(model, name)) for name in triggers)
