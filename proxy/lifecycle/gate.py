"""`RequestGate`: admission of inference requests, the bounded hold queue, and in-flight counting.

The coordinator sets the admission after every state change; the fast path (RUNNING) is one comparison and a
counter. A held request is `Parked`: callbacks and a deadline, no task or timer of its own; one timer serves all.
It ends exactly one way: released, client gone, `HoldTimeout`, `HoldQueueFull` or `ShuttingDown`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import EngineSleeping, EngineUnavailable, HoldQueueFull, HoldTimeout, LifeguardError, ShuttingDown
from .rules import Admission

# Held requests released per event-loop turn. Releasing 10,000 in one turn runs every handler up to its
# first upstream await before any socket is polled: nothing is forwarded for seconds and every one opens
# its own connection at once (measured: first forward 12 s after the wake, most failed to connect).
RELEASE_BATCH = 32


class Ticket:
    """Proof of admission; `done()` must be called once the upstream exchange has ended."""

    __slots__ = ("_gate", "_done", "held_s")

    def __init__(self, gate: RequestGate, held_s: float) -> None:
        self._gate = gate
        self._done = False
        self.held_s = held_s

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._gate._finished()


class ParkedOwner(Protocol):
    """What a parked request is told: admitted (forward it now), or refused with the error to answer."""

    def admitted(self, ticket: Ticket) -> None: ...

    def refused(self, error: LifeguardError) -> None: ...


class Parked:
    """A request held in the gate's queue; `cancel()` when its client leaves."""

    __slots__ = ("_gate", "_owner", "_size", "_deadline", "_started", "_ended")

    def __init__(self, gate: RequestGate, owner: ParkedOwner, size: int, deadline: float) -> None:
        self._gate = gate
        self._owner = owner
        self._size = size
        self._deadline = deadline  # on the loop's clock; the gate's one timer ends it (`_deadlines_due`)
        self._started = time.monotonic()
        self._ended = False

    def cancel(self) -> None:
        if self._end("client_gone"):
            self._gate._forget(self)

    def _expired(self) -> None:
        if self._end("hold_timeout"):
            self._gate._forget(self)
            timeout = self._gate._hold_timeout_s
            error = HoldTimeout(f"held {timeout:g} s while the engine was not ready; giving up", retry_after=5.0)
            self._owner.refused(error)

    def _release(self) -> bool:
        if not self._end("forwarded"):
            return False
        self._owner.admitted(self._gate._admitted(time.monotonic() - self._started))
        return True

    def _fail(self, error: LifeguardError) -> None:
        if self._end(error.reason):
            self._owner.refused(error)

    def _end(self, outcome: str) -> bool:
        if self._ended:
            return False
        self._ended = True
        self._gate._held_bytes -= self._size
        self._gate._on_hold_ended(outcome, time.monotonic() - self._started)
        return True


class RequestGate:
    def __init__(
        self,
        *,
        max_held: int,
        hold_timeout_s: float,
        max_held_bytes: int | None = None,
        on_hold_ended: Callable[[str, float], None] = lambda outcome, seconds: None,
    ) -> None:
        self._max_held = max_held
        self._max_held_bytes = max_held_bytes
        self._held_bytes = 0
        self._hold_timeout_s = hold_timeout_s
        self._on_hold_ended = on_hold_ended
        # Set by the wake-on-request policy, which is built after the gate.
        self.on_held_while_sleeping: Callable[[], None] = lambda: None
        self._admission = Admission.HOLD
        self._refusal: LifeguardError | None = None
        self._sleeping = False
        self._held: collections.deque[Parked] = collections.deque()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed: LifeguardError | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.last_activity = time.monotonic()

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def oldest_held_since(self) -> float | None:
        """When the request held longest arrived (time.monotonic()), if any is held."""
        return self._held[0]._started if self._held else None

    @property
    def admission(self) -> Admission:
        return self._admission

    def set_admission(
        self, admission: Admission, *, sleeping: bool = False, refusal: LifeguardError | None = None
    ) -> None:
        """Told by the coordinator after each change; FORWARD releases every held request in arrival order.
        `refusal`: with REJECT_FAILED, the error new requests get (saying why the engine failed). Requests held
        before the engine was known asleep (held while it started or fell asleep) ask for the wake as one that
        arrives while it sleeps would."""
        was_sleeping, self._sleeping = self._sleeping, sleeping
        self._admission = admission
        self._refusal = refusal
        if admission is Admission.FORWARD:
            self._release_batch()
        elif admission is Admission.REJECT_SLEEPING:
            self._fail_held(EngineSleeping("the engine is asleep and this proxy rejects requests while it sleeps"))
        elif sleeping and not was_sleeping and self._held:
            self.on_held_while_sleeping()

    def _release_batch(self) -> None:
        released = 0
        while self._held and released < RELEASE_BATCH:
            released += self._held.popleft()._release()
        if self._held and self._admission is Admission.FORWARD:
            asyncio.get_running_loop().call_soon(self._release_batch)

    @property
    def closed(self) -> bool:
        """Shutting down: held requests were answered 503 and new ones are refused."""
        return self._closed is not None

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def try_admit(self) -> Ticket | None:
        """A ticket when the request may be forwarded at once, else None (the caller then `park`s it)."""
        self.last_activity = time.monotonic()
        # While a release drains, newcomers queue behind the held requests: arrival order is kept.
        if self._admission is Admission.FORWARD and self._closed is None and not self._held:
            return self._admitted(0.0)
        return None

    def park(self, owner: ParkedOwner, size: int = 0) -> Parked:
        """Hold a request (of `size` body bytes) after `try_admit` said no. Raises the LifeguardError of a request
        refused at once; otherwise `owner` is told exactly once how the hold ended (admitted, or refused with
        the error), unless the request is cancelled first."""
        self._check_room(size)
        self._held_bytes += size
        loop = asyncio.get_running_loop()
        parked = Parked(self, owner, size, loop.time() + self._hold_timeout_s)
        self._held.append(parked)
        if self._deadline_timer is None:  # else it is armed at an earlier deadline, which re-arms it
            self._deadline_timer = loop.call_at(parked._deadline, self._deadlines_due)
        if self._sleeping:
            self.on_held_while_sleeping()
        return parked

    def _deadlines_due(self) -> None:
        """The one deadline timer: end every parked request whose deadline has come (they are in deadline
        order), then arm it at the next one."""
        self._deadline_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due: list[Parked] = []
        for waiter in self._held:
            if waiter._deadline > now:
                break
            due.append(waiter)
        for parked in due:
            parked._expired()  # its owner's answer may park a request, arming the timer: re-armed below
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._held:
            self._deadline_timer = loop.call_at(self._held[0]._deadline, self._deadlines_due)

    def _check_room(self, size: int) -> None:
        """Raise the error of a request that may not be held."""
        if self._closed is not None:
            raise self._closed
        if self._admission is Admission.REJECT_FAILED:
            error = self._refusal or EngineUnavailable(
                "the engine has failed; the proxy refuses new requests until it is back"
            )
            self._on_hold_ended(error.reason, 0.0)
            raise error
        if self._admission is Admission.REJECT_SLEEPING:
            raise EngineSleeping("the engine is asleep and this proxy rejects requests while it sleeps")
        if len(self._held) >= self._max_held:
            self._on_hold_ended("hold_queue_full", 0.0)
            raise HoldQueueFull(f"{len(self._held)} requests are already held; the limit is {self._max_held}")
        if self._max_held_bytes is not None and self._held_bytes + size > self._max_held_bytes:
            self._on_hold_ended("hold_queue_full", 0.0)
            raise HoldQueueFull(
                f"held request bodies take {self._held_bytes} bytes; this one ({size}) would pass the limit "
                f"of {self._max_held_bytes}"
            )

    def _admitted(self, held_s: float) -> Ticket:
        self._inflight += 1
        self._idle.clear()
        return Ticket(self, held_s)

    def _finished(self) -> None:
        self._inflight -= 1
        self.last_activity = time.monotonic()
        if self._inflight == 0:
            self._idle.set()

    def _forget(self, waiter: Parked) -> None:
        try:
            self._held.remove(waiter)
        except ValueError:
            pass

    def _fail_held(self, error: LifeguardError) -> None:
        while self._held:
            self._held.popleft()._fail(error)

    def refuse_held(self, error: LifeguardError) -> None:
        """Answer every held request `error` now (a wake that cannot happen: waiting out the deadline would
        not change it); new requests are admitted as before."""
        self._fail_held(error)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight, at most `timeout_s`; returns whether it became idle."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Shutdown: held requests are answered 503 at once; in-flight ones run on."""
        self._closed = ShuttingDown("the proxy is shutting down")
        self._fail_held(self._closed)
