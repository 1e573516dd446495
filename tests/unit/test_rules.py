"""Every row of the lifecycle rules table, judged against a snapshot of our state (no I/O)."""

from __future__ import annotations

import pytest

from proxy.calls import LifecycleCall, parse_call
from proxy.rules import Admission, Defer, EngineView, Noop, Refuse, Run, Staleness, admission, judge
from proxy.states import State

ASLEEP_1 = EngineView(State.SLEEPING, sleep_level=1, asleep_tags=frozenset({"weights", "kv_cache"}))
KV_ONLY = EngineView(State.SLEEPING, sleep_level=1, asleep_tags=frozenset({"kv_cache"}))
RUNNING = EngineView(State.RUNNING)
PAUSED = EngineView(State.PAUSED, user_pause="abort")
UPDATING = EngineView(State.UPDATING_WEIGHTS, weight_update_active=True)


def call(op: str, *query: tuple[str, str], body: bytes = b"") -> LifecycleCall:
    return parse_call(op, list(query), body)


def reason(decision: object) -> str:
    assert isinstance(decision, Refuse), decision
    return decision.error.reason


@pytest.mark.parametrize("view", [RUNNING, PAUSED])
def test_sleep_runs_from_running_and_paused(view: EngineView) -> None:
    assert isinstance(judge(call("sleep"), view), Run)


def test_sleep_at_the_same_level_is_a_noop_and_at_another_is_409() -> None:
    assert judge(call("sleep", ("level", "1")), ASLEEP_1) == Noop({"status": "sleeping", "level": 1})
    assert reason(judge(call("sleep", ("level", "0")), ASLEEP_1)) == "already_asleep"


def test_wake_runs_only_for_tags_still_asleep() -> None:
    assert isinstance(judge(call("wake_up"), ASLEEP_1), Run)
    assert isinstance(judge(call("wake_up", ("tags", "kv_cache")), KV_ONLY), Run)
    assert isinstance(judge(call("wake_up", ("tags", "weights")), KV_ONLY), Noop)


@pytest.mark.parametrize("view", [RUNNING, PAUSED])
def test_wake_of_an_awake_or_merely_paused_engine_is_a_noop_not_forwarded(view: EngineView) -> None:
    # vLLM's /wake_up would resume a paused engine: never send it.
    assert judge(call("wake_up"), view) == Noop({"status": "awake", "tags": None})


def test_pause_runs_from_running_is_a_noop_when_paused_and_is_recorded_while_asleep() -> None:
    assert isinstance(judge(call("pause"), RUNNING), Run)
    assert isinstance(judge(call("pause"), PAUSED), Noop)
    assert isinstance(judge(call("pause"), ASLEEP_1), Defer)


def test_resume_runs_from_paused_is_a_noop_when_running_and_refused_while_asleep() -> None:
    assert isinstance(judge(call("resume"), PAUSED), Run)
    assert isinstance(judge(call("resume"), RUNNING), Noop)
    assert reason(judge(call("resume"), ASLEEP_1)) == "engine_asleep"
    assert reason(judge(call("resume"), KV_ONLY)) == "engine_asleep"


@pytest.mark.parametrize("view", [RUNNING, PAUSED, KV_ONLY])
def test_a_weight_update_starts_where_the_weights_are_awake(view: EngineView) -> None:
    assert isinstance(judge(call("start_weight_update"), view), Run)


def test_a_weight_update_is_refused_with_weights_asleep_or_a_session_open() -> None:
    assert reason(judge(call("start_weight_update"), ASLEEP_1)) == "weights_asleep"
    assert reason(judge(call("update_weights"), ASLEEP_1)) == "weights_asleep"
    assert reason(judge(call("start_weight_update"), UPDATING)) == "weight_update_active"


def test_finish_needs_an_open_session() -> None:
    assert reason(judge(call("finish_weight_update"), RUNNING)) == "no_weight_update_session"
    assert isinstance(judge(call("finish_weight_update"), UPDATING), Run)


@pytest.mark.parametrize("op", ["sleep", "wake_up", "pause", "resume"])
def test_sleep_wake_pause_resume_wait_for_an_open_session_to_finish(op: str) -> None:
    assert reason(judge(call(op), UPDATING)) == "weight_update_in_progress"


@pytest.mark.parametrize("state", [State.STARTING, State.FAILED])
@pytest.mark.parametrize("op", ["sleep", "wake_up", "pause", "resume", "start_weight_update"])
def test_nothing_runs_on_an_engine_that_is_not_up(state: State, op: str) -> None:
    assert reason(judge(call(op), EngineView(state))) == "engine_unavailable"


def test_collective_rpc_runs_whenever_the_engine_is_up() -> None:
    rpc = call("collective_rpc", body=b'{"method": "reload_weights"}')
    for view in (RUNNING, PAUSED, ASLEEP_1, KV_ONLY, UPDATING):
        assert isinstance(judge(rpc, view), Run)


def test_inference_is_forwarded_only_in_running_with_valid_weights() -> None:
    def adm(view: EngineView, on_sleeping: str = "hold", hold_restarted: bool = False) -> Admission:
        return admission(view, on_sleeping=on_sleeping, hold_while_restarted=hold_restarted)

    assert adm(RUNNING) is Admission.FORWARD
    for state in (State.STARTING, State.PAUSED, State.SLEEPING, State.WAKING, State.UPDATING_WEIGHTS):
        assert adm(EngineView(state)) is Admission.HOLD
    assert adm(EngineView(State.FAILED)) is Admission.REJECT_FAILED
    assert adm(ASLEEP_1, on_sleeping="reject") is Admission.REJECT_SLEEPING
    assert adm(EngineView(State.RUNNING, weights_stale=Staleness.DISCARDED)) is Admission.HOLD
    assert adm(EngineView(State.RUNNING, weights_stale=Staleness.RESTARTED)) is Admission.FORWARD
    assert adm(EngineView(State.RUNNING, weights_stale=Staleness.RESTARTED), hold_restarted=True) is Admission.HOLD


def test_weight_writing_rpcs_are_refused_while_the_weights_are_asleep() -> None:
    methods = frozenset({"reload_weights", "update_weights_nccl"})
    for method in methods:
        rpc = call("collective_rpc", body=b'{"method": "%s"}' % method.encode())
        assert reason(judge(rpc, ASLEEP_1, methods)) == "weights_asleep"
        assert isinstance(judge(rpc, KV_ONLY, methods), Run)
    other = call("collective_rpc", body=b'{"method": "echo"}')
    assert isinstance(judge(other, ASLEEP_1, methods), Run)
