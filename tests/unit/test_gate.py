"""Every way a held request can end, driven by direct calls (no HTTP, no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import EngineSleeping, EngineUnavailable, HoldQueueFull, HoldTimeout, LifeguardError, ShuttingDown
from proxy.gate import RequestGate, Ticket
from proxy.rules import Admission


def gate(max_held: int = 10, hold_timeout_s: float = 30.0) -> tuple[RequestGate, list[str]]:
    endings: list[str] = []
    g = RequestGate(
        max_held=max_held, hold_timeout_s=hold_timeout_s, on_hold_ended=lambda outcome, s: endings.append(outcome)
    )
    return g, endings


async def held(g: RequestGate, count: int) -> None:
    """Let the event loop run until `count` requests sit in the queue."""
    for _ in range(1000):
        if g.held == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{g.held} held, expected {count}")


async def test_running_admits_at_once_and_counts_in_flight() -> None:
    g, _ = gate()
    g.set_admission(Admission.FORWARD)
    ticket = await g.admit()
    assert g.inflight == 1
    ticket.done()
    ticket.done()  # idempotent
    assert g.inflight == 0


async def test_held_requests_are_released_in_arrival_order() -> None:
    g, endings = gate()
    order: list[int] = []

    async def request(n: int) -> None:
        ticket = await g.admit()
        order.append(n)
        ticket.done()

    tasks = [asyncio.ensure_future(request(n)) for n in range(5)]
    await held(g, 5)
    g.set_admission(Admission.FORWARD)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert endings == ["forwarded"] * 5


async def test_a_held_request_times_out_with_503_hold_timeout() -> None:
    g, endings = gate(hold_timeout_s=0.05)
    with pytest.raises(HoldTimeout) as err:
        await g.admit()
    assert err.value.status == 503 and err.value.retry_after
    assert g.held == 0 and endings == ["hold_timeout"]


async def test_a_client_that_leaves_is_removed_and_never_forwarded() -> None:
    g, endings = gate()
    task = asyncio.ensure_future(g.admit())
    await held(g, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.held == 0 and endings == ["client_gone"]
    g.set_admission(Admission.FORWARD)
    assert g.inflight == 0


async def test_a_full_queue_answers_503_hold_queue_full_at_once() -> None:
    g, endings = gate(max_held=1)
    first = asyncio.ensure_future(g.admit())
    await held(g, 1)
    with pytest.raises(HoldQueueFull):
        await g.admit()
    assert endings == ["hold_queue_full"]
    first.cancel()


async def test_shutdown_answers_every_held_request_503_shutting_down() -> None:
    g, endings = gate()
    tasks = [asyncio.ensure_future(g.admit()) for _ in range(3)]
    await held(g, 3)
    g.close()
    for task in tasks:
        with pytest.raises(ShuttingDown):
            await task
    with pytest.raises(ShuttingDown):
        await g.admit()
    assert endings == ["shutting_down"] * 3


async def test_a_failed_engine_refuses_new_requests_but_held_ones_keep_waiting() -> None:
    g, _ = gate()
    waiting = asyncio.ensure_future(g.admit())
    await held(g, 1)
    g.set_admission(Admission.REJECT_FAILED)
    with pytest.raises(EngineUnavailable):
        await g.admit()
    assert g.held == 1 and not waiting.done()
    g.set_admission(Admission.FORWARD)  # the engine came back
    (await waiting).done()


async def test_reject_while_sleeping_fails_new_and_held_requests_with_engine_sleeping() -> None:
    g, _ = gate()
    waiting = asyncio.ensure_future(g.admit())
    await held(g, 1)
    g.set_admission(Admission.REJECT_SLEEPING, sleeping=True)
    with pytest.raises(EngineSleeping):
        await waiting
    with pytest.raises(EngineSleeping):
        await g.admit()


async def test_wait_idle_returns_when_the_last_request_finishes() -> None:
    g, _ = gate()
    g.set_admission(Admission.FORWARD)
    ticket = await g.admit()
    assert not await g.wait_idle(0.01)
    waiter = asyncio.ensure_future(g.wait_idle(5))
    ticket.done()
    assert await waiter


async def test_a_large_release_drains_in_batches_and_newcomers_queue_behind_it() -> None:
    g, endings = gate(max_held=1000)
    order: list[int] = []

    async def request(n: int) -> None:
        ticket = await g.admit()
        order.append(n)
        ticket.done()

    tasks = [asyncio.ensure_future(request(n)) for n in range(200)]
    await held(g, 200)
    g.set_admission(Admission.FORWARD)
    assert 0 < g.held < 200  # one batch per loop turn, not all at once
    tasks.append(asyncio.ensure_future(request(200)))  # arrives while the backlog drains
    await asyncio.gather(*tasks)
    assert order == list(range(201))
    assert endings.count("forwarded") == 201


class Owner:
    """A raw-front request parked in the gate: records how its hold ended."""

    def __init__(self, g: RequestGate, name: str, order: list[str]) -> None:
        self.gate, self.name, self.order = g, name, order
        self.error: LifeguardError | None = None
        self.ticket: Ticket | None = None

    def admitted(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.order.append(self.name)

    def refused(self, error: LifeguardError) -> None:
        self.error = error


async def test_parked_and_waiting_requests_are_released_together_in_arrival_order() -> None:
    g, endings = gate()
    order: list[str] = []
    first = Owner(g, "parked-1", order)
    g.park(first, 10)

    async def waiting() -> None:
        ticket = await g.admit()
        order.append("admit")
        ticket.done()

    task = asyncio.ensure_future(waiting())
    await held(g, 2)
    g.park(Owner(g, "parked-2", order))
    assert g.held == 3 and g.held_bytes == 10
    g.set_admission(Admission.FORWARD)
    await task
    # One release, in arrival order; a coroutine waiter goes on at its next turn, a parked one at once.
    assert order == ["parked-1", "parked-2", "admit"]
    assert endings == ["forwarded"] * 3 and g.held == 0 and g.held_bytes == 0
    assert first.ticket is not None and g.inflight == 2
    first.ticket.done()


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
    assert timer is not None and timer.when() == a._deadline <= b._deadline
    a._deadline = b._deadline = 0.0  # both due, without waiting for them
    g.park(third)
    g._deadlines_due()
    assert isinstance(first.error, HoldTimeout) and isinstance(second.error, HoldTimeout) and third.error is None
    assert endings == ["hold_timeout", "hold_timeout"] and g.held == 1
    # Armed again at the one left, and only once.
    assert g._deadline_timer is not None and g._deadline_timer is not timer
    assert g._deadline_timer.when() == g._held[0]._deadline  # type: ignore[union-attr]


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
