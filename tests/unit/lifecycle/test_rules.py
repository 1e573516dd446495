"""Every row of the lifecycle rules table, judged against a snapshot of our state (no I/O)."""

from __future__ import annotations

import json

import pytest

from proxy.errors import BadParameter
from proxy.lifecycle.parsed_calls import LifecycleCall, parse_call
from proxy.lifecycle.rules import Admission, Defer, EngineView, Noop, Refuse, Run, Staleness, admission, judge
from proxy.lifecycle.states import State

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


# --- SkyRL 0.4.0's worker RPCs (proxy/lifecycle/worker_rpcs.py) and the drafter's weight update session


def rpc(method: str, **kwargs: object) -> LifecycleCall:
    return call("collective_rpc", body=json.dumps({"method": method, "kwargs": kwargs}).encode())


KEPT = EngineView(State.PAUSED, user_pause="keep")
IN_WORKER = EngineView(
    State.SLEEPING, asleep_tags=frozenset({"weights", "kv_cache"}), user_pause="keep", asleep_outside_vllm=True
)
KV_IN_WORKER = EngineView(
    State.SLEEPING, asleep_tags=frozenset({"kv_cache"}), user_pause="keep", asleep_outside_vllm=True
)


def test_sleep_for_weight_sync_runs_only_from_a_pause() -> None:
    assert isinstance(judge(rpc("skyrl_sleep_for_weight_sync", offload_kv=True), KEPT), Run)
    # Under a running scheduler it would free the memory running requests use.
    assert reason(judge(rpc("skyrl_sleep_for_weight_sync"), RUNNING)) == "not_paused"
    assert reason(judge(rpc("skyrl_sleep_for_weight_sync"), ASLEEP_1)) == "already_asleep"
    assert reason(judge(rpc("skyrl_sleep_for_weight_sync"), UPDATING)) == "weight_update_in_progress"
    # A repeat would unmap what is unmapped: answered by us, as vLLM answers a method that returns nothing.
    assert judge(rpc("skyrl_sleep_for_weight_sync"), IN_WORKER) == Noop({"results": [None]})
    assert reason(judge(rpc("skyrl_sleep_for_weight_sync"), KV_IN_WORKER)) == "already_asleep"


def test_wake_for_weight_sync_wakes_only_what_the_worker_put_to_sleep() -> None:
    assert isinstance(judge(rpc("skyrl_wake_for_weight_sync", tags=["weights"]), IN_WORKER), Run)
    assert isinstance(judge(rpc("skyrl_wake_for_weight_sync", tags=["kv_cache"]), KV_IN_WORKER), Run)
    assert judge(rpc("skyrl_wake_for_weight_sync", tags=["weights"]), KV_IN_WORKER) == Noop({"results": [None]})
    # Nothing known asleep: a worker sleep the proxy did not see (restarted without its state file) reads the
    # same, so vLLM's own answer decides.
    assert isinstance(judge(rpc("skyrl_wake_for_weight_sync", tags=["weights"]), KEPT), Run)
    # Pools vLLM's own /sleep freed are woken by /wake_up, or vLLM's executor would still believe them asleep.
    assert reason(judge(rpc("skyrl_wake_for_weight_sync", tags=["weights"]), ASLEEP_1)) == "engine_asleep"


@pytest.mark.parametrize("op", ["sleep", "wake_up", "resume", "release_kv_cache_memory"])
def test_vllms_own_calls_are_refused_while_the_worker_holds_the_memory_asleep(op: str) -> None:
    # vLLM's executor does not know: /wake_up and /resume would schedule on freed memory.
    assert reason(judge(call(op), IN_WORKER)) in ("already_asleep", "engine_asleep")
    assert "skyrl_wake_for_weight_sync" in judge(call(op), IN_WORKER).error.message  # type: ignore[union-attr]


def test_a_weight_push_waits_for_the_worker_to_wake_the_weights() -> None:
    assert reason(judge(call("start_weight_update"), IN_WORKER)) == "weights_asleep"
    assert isinstance(judge(call("start_weight_update"), KV_IN_WORKER), Run)


@pytest.mark.parametrize(
    "body",
    [
        {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["weights", "gpu"]}},
        {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": "weights"}},
        {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": "yes"}},
        {"method": "skyrl_sleep_for_weight_sync", "args": ["true"]},
    ],
)
def test_malformed_worker_sleep_rpcs_are_400_naming_the_argument(body: dict[str, object]) -> None:
    with pytest.raises(BadParameter) as raised:
        call("collective_rpc", body=json.dumps(body).encode())
    assert raised.value.param is not None and raised.value.param.startswith("body.")


def test_a_drafter_session_follows_the_rules_of_a_session() -> None:
    assert isinstance(judge(call("start_draft_weight_update"), RUNNING), Run)
    assert isinstance(judge(call("start_draft_weight_update"), KEPT), Run)
    # vLLM's worker holds one session at a time, the drafter's included.
    assert reason(judge(call("start_draft_weight_update"), UPDATING)) == "weight_update_active"
    assert reason(judge(call("start_draft_weight_update"), ASLEEP_1)) == "weights_asleep"


# ----- vLLM 0.34's process checkpoint (docs/verification.md, class 25)
@pytest.mark.parametrize(
    ("op", "query"),
    [("sleep", [("level", "1")]), ("wake_up", []), ("resume", []), ("release_kv_cache_memory", []),
     ("start_weight_update", []), ("update_weights", []), ("finish_weight_update", [])],
)  # fmt: skip
def test_while_prepared_for_a_checkpoint_what_vllm_answers_500_is_refused_409_saying_to_restore(
    op: str, query: list[tuple[str, str]]
) -> None:
    decision = judge(parse_call(op, query, b""), EngineView(State.CHECKPOINTED))
    assert isinstance(decision, Refuse)
    assert decision.error.status == 409 and decision.error.reason == "checkpoint_prepared"
    assert "/checkpoint/restore" in decision.error.message


def test_a_checkpoint_is_prepared_from_awake_engines_only_and_each_call_is_a_no_op_where_vllm_makes_it_one() -> None:
    prepare, restore = parse_call("checkpoint_prepare", [], b""), parse_call("checkpoint_restore", [], b"")
    assert prepare.mode == "wait"  # vLLM's default drain
    assert isinstance(judge(prepare, EngineView(State.RUNNING)), Run)
    assert isinstance(judge(prepare, EngineView(State.PAUSED)), Run)
    assert isinstance(judge(prepare, EngineView(State.CHECKPOINTED)), Noop)
    refused = judge(prepare, EngineView(State.SLEEPING, sleep_level=1))
    assert isinstance(refused, Refuse) and refused.error.reason == "engine_asleep"
    assert isinstance(judge(restore, EngineView(State.CHECKPOINTED)), Run)
    assert isinstance(judge(restore, EngineView(State.RUNNING)), Noop)
    assert isinstance(judge(parse_call("pause", [], b""), EngineView(State.CHECKPOINTED)), Defer)
    assert admission(EngineView(State.CHECKPOINTED), on_sleeping="reject", hold_while_restarted=False) is (
        Admission.HOLD
    )
