"""`/lifeguard/serving`'s rule (rules.serving_refusal) against the gate itself: over every snapshot Hypothesis
makes, "serving" is exactly "the real `RequestGate`, told what the coordinator tells it, forwards a request at
once", and every "not serving" names the cause the gate acts on (held, or refused with which error)."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import EngineSleeping, EngineUnavailable, LifeguardError, NotServing, ShuttingDown
from proxy.front.readiness import SERVING, engines_answer
from proxy.lifecycle.gate import RequestGate, Ticket
from proxy.lifecycle.rules import NOT_SERVING_CAUSES, EngineView, Staleness, admission, serving_refusal
from proxy.lifecycle.states import State

views = st.builds(
    EngineView,
    state=st.sampled_from(State),
    sleep_level=st.none() | st.integers(0, 2),
    asleep_tags=st.frozensets(st.sampled_from(["weights", "kv_cache", "scheduling"])),
    user_pause=st.none() | st.sampled_from(["abort", "wait", "keep"]),
    weight_update_active=st.booleans(),
    weights_stale=st.none() | st.sampled_from(Staleness),
    sleep_unconfirmed=st.booleans(),
    swapping_out_for=st.none() | st.just("judge"),
)
policies = st.sampled_from(["hold", "reject", "wake"])


class Owner:
    """A parked request's owner that only records what the gate told it."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def admitted(self, ticket: Ticket) -> None:
        self.told.append("admitted")
        ticket.done()

    def refused(self, error: LifeguardError) -> None:
        self.told.append(error.reason)


async def what_the_gate_does(view: EngineView, on_sleeping: str, hold_while_restarted: bool, closed: bool) -> str:
    """A new inference request through a real gate, set up as the coordinator sets it (`_refresh_gate`)."""
    gate = RequestGate(max_held=10, hold_timeout_s=30)
    decision = admission(view, on_sleeping=on_sleeping, hold_while_restarted=hold_while_restarted)
    gate.set_admission(decision, sleeping=view.state is State.SLEEPING)
    if closed:
        gate.close()
    ticket = gate.try_admit()
    if ticket is not None:
        ticket.done()
        return "forwarded"
    owner = Owner()
    try:
        parked = gate.park(owner)
    except LifeguardError as exc:
        return exc.reason
    assert gate.held == 1 and owner.told == []
    parked.cancel()
    return "held"


def check_agreement(view: EngineView, on_sleeping: str, hold_while_restarted: bool, closed: bool, done: str) -> None:
    refusal = serving_refusal(view, on_sleeping=on_sleeping, hold_while_restarted=hold_while_restarted, closed=closed)
    if refusal is None:
        assert done == "forwarded"
        return
    assert done != "forwarded", f"not serving ({refusal.details}) but the gate forwarded at once"
    assert refusal.status == 503 and refusal.reason == "not_serving" and refusal.message
    assert refusal.details["state"] == view.state.value
    cause = refusal.details["cause"]
    assert cause in NOT_SERVING_CAUSES
    # The cause is the one the gate acts on.
    expected = {
        "shutting_down": ShuttingDown.reason,
        "failed": EngineUnavailable.reason,
        "asleep": EngineSleeping.reason if on_sleeping == "reject" else "held",
    }.get(cause, "held")
    assert done == expected, f"cause {cause}: the gate's request was {done}"


async def test_serving_is_exactly_what_the_gate_forwards_at_once_in_every_state() -> None:
    """Every combination of what the gate's admission reads, each state with the facts it usually has."""
    facts = {
        State.SLEEPING: {"sleep_level": 1, "asleep_tags": frozenset({"weights", "kv_cache"})},
        State.PAUSED: {"user_pause": "abort"},
        State.UPDATING_WEIGHTS: {"weight_update_active": True},
    }
    for state, stale, on_sleeping, hold_restarted, closed in itertools.product(
        State, (None, *Staleness), ("hold", "reject", "wake"), (False, True), (False, True)
    ):
        view = EngineView(state, weights_stale=stale, **facts.get(state, {}))  # type: ignore[arg-type]
        done = await what_the_gate_does(view, on_sleeping, hold_restarted, closed)
        check_agreement(view, on_sleeping, hold_restarted, closed, done)


@settings(max_examples=300)
@given(view=views, on_sleeping=policies, hold_while_restarted=st.booleans(), closed=st.booleans())
def test_serving_is_what_the_gate_forwards_at_once_whatever_else_the_view_says(
    view: EngineView, on_sleeping: str, hold_while_restarted: bool, closed: bool
) -> None:
    """Snapshots the record never makes too (RUNNING with tags asleep, a level without tags...)."""
    done = asyncio.run(what_the_gate_does(view, on_sleeping, hold_while_restarted, closed))
    check_agreement(view, on_sleeping, hold_while_restarted, closed, done)


def test_each_state_names_its_cause() -> None:
    def cause(view: EngineView, on_sleeping: str = "hold", restarted_held: bool = False, closed: bool = False) -> str:
        refusal = serving_refusal(view, on_sleeping=on_sleeping, hold_while_restarted=restarted_held, closed=closed)
        return "serving" if refusal is None else str(refusal.details["cause"])

    asleep = EngineView(State.SLEEPING, sleep_level=1, asleep_tags=frozenset({"weights", "kv_cache"}))
    assert cause(EngineView(State.RUNNING)) == "serving"
    assert cause(EngineView(State.RUNNING, swapping_out_for="judge")) == "swapping_out"  # drained for a swap
    assert cause(EngineView(State.SCALING)) == "scaling"
    assert cause(EngineView(State.RUNNING), closed=True) == "shutting_down"
    assert cause(asleep) == cause(asleep, on_sleeping="wake") == cause(asleep, on_sleeping="reject") == "asleep"
    assert cause(EngineView(State.FALLING_ASLEEP)) == "falling_asleep"
    assert cause(EngineView(State.WAKING)) == "waking"
    assert cause(EngineView(State.PAUSED, user_pause="keep")) == "paused"
    assert cause(EngineView(State.UPDATING_WEIGHTS, weight_update_active=True)) == "updating_weights"
    assert cause(EngineView(State.STARTING)) == "starting"
    assert cause(EngineView(State.FAILED)) == "failed"
    assert cause(EngineView(State.RUNNING, weights_stale=Staleness.DISCARDED)) == "weights_discarded"
    # A restarted engine's initial checkpoint is served unless `hold_while_weights_stale` says otherwise.
    restarted = EngineView(State.RUNNING, weights_stale=Staleness.RESTARTED)
    assert cause(restarted) == "serving"
    assert cause(restarted, restarted_held=True) == "weights_stale"


def test_a_sleeping_engine_s_message_says_what_a_request_sent_to_it_gets() -> None:
    asleep = EngineView(State.SLEEPING, sleep_level=2, asleep_tags=frozenset({"weights", "kv_cache"}))
    for on_sleeping, says in (("hold", "held until a wake"), ("wake", "wakes it"), ("reject", "refused")):
        refusal = serving_refusal(asleep, on_sleeping=on_sleeping, hold_while_restarted=False, closed=False)
        assert refusal is not None
        assert "level 2" in refusal.message and says in refusal.message, refusal.message


def test_several_engines_serve_while_any_one_does() -> None:
    asleep = NotServing("asleep", state="SLEEPING", cause="asleep")
    failed = NotServing("failed", state="FAILED", cause="failed")
    answer = engines_answer({"a": asleep, "b": None})
    assert answer == {
        "serving": True,
        "engines": {"a": {"serving": False, "state": "SLEEPING", "cause": "asleep", "message": "asleep"}, "b": SERVING},
    }
    refused = engines_answer({"a": asleep, "b": failed})
    assert isinstance(refused, NotServing)
    assert refused.message == "no engine can serve now: a (asleep), b (failed)"
    assert refused.details["engines"]["b"] == {
        "serving": False,
        "state": "FAILED",
        "cause": "failed",
        "message": "failed",
    }
