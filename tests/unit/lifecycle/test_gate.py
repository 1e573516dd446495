"""Every way a held request can end, driven by direct calls (no HTTP, no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import EngineSleeping, EngineUnavailable, HoldQueueFull, HoldTimeout, LifeguardError, ShuttingDown
from proxy.lifecycle.gate import RequestGate, Ticket
from proxy.lifecycle.rules import Admission


def gate(max_held: int = 10, hold_timeout_s: float = 30.0) -> tuple[RequestGate, list[str]]:
    endings: list[str] = []
    g = RequestGate(
        max_held=max_held, hold_timeout_s=hold_timeout_s, on_hold_ended=lambda outcome, s: endings.append(outcome)
    )
    return g, endings


class Waiter:
    """A held request as the front parks it, with a future the test can await."""

    def __init__(self) -> None:
        self.future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()

    def admitted(self, ticket: Ticket) -> None:
        self.future.set_result(ticket)

    def refused(self, error: LifeguardError) -> None:
        self.future.set_exception(error)


async def admit(g: RequestGate, size: int = 0) -> Ticket:
    """Forwarded at once, or parked until the gate says how the hold ended (cancelled: the client left)."""
    ticket = g.try_admit()
    if ticket is not None:
        return ticket
    waiter = Waiter()
    parked = g.park(waiter, size)
    try:
        return await waiter.future
    except asyncio.CancelledError:
        parked.cancel()
        raise


async def held(g: RequestGate, count: int) -> None:
    """Let the event loop run until `count` requests sit in the queue."""
    for _ in range(1000):
        if g.held == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{g.held} held, expected {count}")


async def request(g: RequestGate, n: int, order: list[int]) -> None:
    """Request number `n`: once admitted, it writes `n` into `order` and ends."""
    ticket = await admit(g)
    order.append(n)
    ticket.done()


async def test_running_admits_at_once_and_counts_in_flight() -> None:
    g, _ = gate()
    g.set_admission(Admission.FORWARD)
    ticket = await admit(g)
    assert g.inflight == 1
    ticket.done()
    ticket.done()  # idempotent
    assert g.inflight == 0


async def test_held_requests_are_released_in_arrival_order() -> None:
    g, endings = gate()
    order: list[int] = []

    tasks = [asyncio.ensure_future(request(g, n, order)) for n in range(5)]
    await held(g, 5)
    g.set_admission(Admission.FORWARD)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert endings == ["forwarded"] * 5


async def test_a_held_request_times_out_with_503_hold_timeout() -> None:
    g, endings = gate(hold_timeout_s=0.05)
    with pytest.raises(HoldTimeout) as err:
        await admit(g)
    assert err.value.status == 503 and err.value.retry_after
    assert g.held == 0 and endings == ["hold_timeout"]


async def test_a_client_that_leaves_is_removed_and_never_forwarded() -> None:
    g, endings = gate()
    task = asyncio.ensure_future(admit(g))
    await held(g, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.held == 0 and endings == ["client_gone"]
    g.set_admission(Admission.FORWARD)
    assert g.inflight == 0


async def test_a_full_queue_answers_503_hold_queue_full_at_once() -> None:
    g, endings = gate(max_held=1)
    first = asyncio.ensure_future(admit(g))
    await held(g, 1)
    with pytest.raises(HoldQueueFull):
        await admit(g)
    assert endings == ["hold_queue_full"]
    first.cancel()


async def test_shutdown_answers_every_held_request_503_shutting_down() -> None:
    g, endings = gate()
    tasks = [asyncio.ensure_future(admit(g)) for _ in range(3)]
    await held(g, 3)
    g.close()
    for task in tasks:
        with pytest.raises(ShuttingDown):
            await task
    with pytest.raises(ShuttingDown):
        await admit(g)
    assert endings == ["shutting_down"] * 3


async def test_a_failed_engine_refuses_new_requests_but_held_ones_keep_waiting() -> None:
    g, _ = gate()
    waiting = asyncio.ensure_future(admit(g))
    await held(g, 1)
    g.set_admission(Admission.REJECT_FAILED)
    with pytest.raises(EngineUnavailable):
        await admit(g)
    assert g.held == 1 and not waiting.done()
    g.set_admission(Admission.FORWARD)  # the engine came back
    (await waiting).done()


async def test_reject_while_sleeping_fails_new_and_held_requests_with_engine_sleeping() -> None:
    g, _ = gate()
    waiting = asyncio.ensure_future(admit(g))
    await held(g, 1)
    g.set_admission(Admission.REJECT_SLEEPING, sleeping=True)
    with pytest.raises(EngineSleeping):
        await waiting
    with pytest.raises(EngineSleeping):
        await admit(g)


async def test_wait_idle_returns_when_the_last_request_finishes() -> None:
    g, _ = gate()
    g.set_admission(Admission.FORWARD)
    ticket = await admit(g)
    assert not await g.wait_idle(0.01)
    waiter = asyncio.ensure_future(g.wait_idle(5))
    ticket.done()
    assert await waiter


async def test_a_large_release_drains_in_batches_and_newcomers_queue_behind_it() -> None:
    g, endings = gate(max_held=1000)
    order: list[int] = []

    tasks = [asyncio.ensure_future(request(g, n, order)) for n in range(200)]
    await held(g, 200)
    g.set_admission(Admission.FORWARD)
    assert 0 < g.held < 200  # one batch per loop turn, not all at once
    tasks.append(asyncio.ensure_future(request(g, 200, order)))  # arrives while the backlog drains
    await asyncio.gather(*tasks)
    assert order == list(range(201))
    assert endings.count("forwarded") == 201


class Owner:
    """A request parked in the gate: records how its hold ended."""

    def __init__(self, g: RequestGate, name: str, order: list[str]) -> None:
        self.gate, self.name, self.order = g, name, order
        self.error: LifeguardError | None = None
        self.ticket: Ticket | None = None

    def admitted(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.order.append(self.name)

    def refused(self, error: LifeguardError) -> None:
        self.error = error


async def test_parked_requests_are_released_in_arrival_order_with_their_bytes_counted() -> None:
    g, endings = gate()
    order: list[str] = []
    first = Owner(g, "parked-1", order)
    g.park(first, 10)
    g.park(Owner(g, "parked-2", order))
    assert g.held == 2 and g.held_bytes == 10
    g.set_admission(Admission.FORWARD)
    assert order == ["parked-1", "parked-2"]
    assert endings == ["forwarded"] * 2 and g.held == 0 and g.held_bytes == 0
    assert first.ticket is not None and g.inflight == 2
    first.ticket.done()


async def test_requests_held_before_the_engine_is_known_asleep_ask_for_its_wake_once_it_is() -> None:
    """Was: a request held while the engine was STARTING (or falling asleep) waited out its whole deadline when
    the engine turned out to be asleep: only a request arriving while it slept asked for the wake (the e2e
    test of two engines from a config file hung on it)."""
    g, _ = gate()
    wakes: list[int] = []
    g.on_held_while_sleeping = lambda: wakes.append(g.held)
    g.set_admission(Admission.HOLD)  # starting: not known asleep
    g.park(Owner(g, "early", []))
    assert wakes == []
    g.set_admission(Admission.HOLD, sleeping=True)
    assert wakes == [1]
    g.set_admission(Admission.HOLD, sleeping=True)  # still asleep: asked once
    g.park(Owner(g, "later", []))  # one arriving while it sleeps asks too
    assert wakes == [1, 2]
    g.set_admission(Admission.HOLD)  # waking, and back asleep (a lying wake): they ask again
    g.set_admission(Admission.HOLD, sleeping=True)
    assert wakes == [1, 2, 2]
    empty, _ = gate()
    empty.on_held_while_sleeping = lambda: wakes.append(-1)
    empty.set_admission(Admission.HOLD, sleeping=True)  # nothing held: nothing to ask for
    assert wakes == [1, 2, 2]


async def test_a_parked_request_ends_once_whether_cancelled_timed_out_or_failed() -> None:
    g, endings = gate(max_held=2)
    order: list[str] = []
    gone, late, last = Owner(g, "gone", order), Owner(g, "late", order), Owner(g, "last", order)
    parked = g.park(gone, 5)
    g.park(late, 5)
    with pytest.raises(HoldQueueFull):
        g.park(last)
    parked.cancel()
    parked.cancel()
    assert endings == ["hold_queue_full", "client_gone"] and g.held == 1 and g.held_bytes == 5
    g._held[0]._expired()  # type: ignore[union-attr]  # its deadline, without waiting for it
    assert isinstance(late.error, HoldTimeout) and late.error.retry_after == 5.0
    g.park(last)
    g.close()
    assert isinstance(last.error, ShuttingDown)
    assert endings == ["hold_queue_full", "client_gone", "hold_timeout", "shutting_down"]
    assert g.held == 0 and g.held_bytes == 0 and order == []
    with pytest.raises(ShuttingDown):
        g.park(Owner(g, "after", order))


async def test_one_timer_ends_parked_requests_at_their_deadlines_in_order() -> None:
    g, endings = gate()
    order: list[str] = []
    first, second, third = Owner(g, "1", order), Owner(g, "2", order), Owner(g, "3", order)
    a, b = g.park(first), g.park(second)
    timer = g._deadline_timer
    # uvloop keeps a timer's time in whole milliseconds, recomputed: its when() is the deadline to within a millisecond
    # either way of rounding (a bound of exactly 1 ms failed once by float error: 17974.701 against 17974.7).
    assert timer is not None and timer.when() == pytest.approx(a._deadline, abs=2e-3) and a._deadline <= b._deadline
    a._deadline = b._deadline = 0.0  # both due, without waiting for them
    g.park(third)
    g._deadlines_due()
    assert isinstance(first.error, HoldTimeout) and isinstance(second.error, HoldTimeout) and third.error is None
    assert endings == ["hold_timeout", "hold_timeout"] and g.held == 1
    # Armed again at the one left, and only once.
    assert g._deadline_timer is not None and g._deadline_timer is not timer
    assert g._deadline_timer.when() == pytest.approx(g._held[0]._deadline, abs=2e-3)  # type: ignore[union-attr]


async def test_parked_requests_time_out_without_other_timers() -> None:
    g, endings = gate(hold_timeout_s=0.0)
    order: list[str] = []
    owners = [Owner(g, str(i), order) for i in range(3)]
    for owner in owners:
        g.park(owner)
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(isinstance(o.error, HoldTimeout) for o in owners) and endings == ["hold_timeout"] * 3
    assert g.held == 0 and g._deadline_timer is None
