"""`Arbiter`: engines on shared GPUs, in this proxy or (with `gpu_lock_dir`) beside other pods' engines.

It stands before each engine's coordinator (its `guard`). Wakes and weight loads are serialized per GPU
(gpu_lock.py); before a wake, memory admission (swap_rules.py) puts neighbours to sleep or refuses with 503
`insufficient_gpu_memory`; requests for a sleeping model wait their turn (`swap_quantum_s`) and are released
together once the wake is verified; a model put to sleep at level 2 is reloaded after its wake. An engine's size
is its `Footprint` (gpu/footprint.py). docs/model-swap.md and docs/design.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..errors import InsufficientGpuMemory, LifeguardError, UpstreamBadStatus
from ..gpu.readers import GpuMemoryReader, GpuReading
from ..lifecycle.engine import Engine, Submit
from ..lifecycle.outcome import Outcome
from ..lifecycle.parsed_calls import LifecycleCall
from ..lifecycle.rules import ALL_SLEEP_TAGS, Staleness, wake_targets
from ..lifecycle.states import State
from ..observe.metrics import Metrics
from .gpu_lock import GpuLocks
from .host_memory import GIB, HostEngine, SleepChoice, available, choices, keeps_backups
from .swap_rules import Evict, Fits, Neighbour, Residency, free_per_gpu, plan_room, residency, wake_need

log = logging.getLogger("lifeguard.arbiter")

#: Calls that put weights or memory onto a GPU: never at the same time as a wake there.
GPU_OPERATIONS = frozenset(
    {"collective_rpc", "start_weight_update", "update_weights", "finish_weight_update", "release_kv_cache_memory"}
)
_NOT_AWAKE = (State.SLEEPING, State.STARTING, State.FAILED)
# A neighbour serving its turn with nothing in flight and no request for this long is idle: its turn ends.
_TURN_IDLE_S = 0.1


@dataclass
class _Turn:
    """A call waiting for (or holding) its GPUs: the swap queue in /lifeguard/state."""

    engine: str
    op: str
    gpus: tuple[int, ...]
    since: float = field(default_factory=time.monotonic)
    running: bool = False


@dataclass
class _Wait:
    """What a swap waits for now (/lifeguard/state): a neighbour's turn (until a time), its drain, its sleep."""

    what: str
    until: float | None = None


class _Guard:
    """The coordinator's `guard` for one engine."""

    def __init__(self, arbiter: Arbiter, name: str) -> None:
        self._arbiter = arbiter
        self._name = name

    @property
    def reloads_discarded_weights(self) -> bool:
        return self._name in self._arbiter.reload_on_wake

    async def run(self, call: LifecycleCall, submit: Submit) -> Outcome:
        return await self._arbiter.run(self._name, call, submit)


class Arbiter:
    def __init__(
        self,
        settings: Settings,
        engines: dict[str, Engine],
        gpu: GpuMemoryReader,
        metrics: Metrics,
        locks: GpuLocks | None = None,
    ) -> None:
        """From now on every lifecycle call of each of `engines` comes here first (its coordinator's guard).
        `locks`: how its GPUs are taken (default: this proxy's lock per GPU only)."""
        self._settings = settings
        self._engines = engines
        self._gpu = gpu
        self._metrics = metrics
        self._locks = locks or GpuLocks(settings.lifecycle_queue_timeout_s, on_wait=metrics.gpu_lock_waited)
        self._turns: list[_Turn] = []
        self._wakes: dict[tuple[str, Any], asyncio.Future[Outcome]] = {}
        # Put to sleep at level 2 by this arbiter: their weights are reloaded after their next wake.
        self.reload_on_wake: set[str] = set()
        self._awake_since: dict[str, float] = {}  # when the arbiter's last wake of each engine ended
        self._waits: dict[str, _Wait] = {}  # what each engine being swapped in waits for now
        # Put to sleep at level 1 by this arbiter on a vLLM that keeps the backup pinned after the wake (0.34).
        self._backups_kept: set[str] = set()
        for name, engine in engines.items():
            engine.guard_with(_Guard(self, name))

    async def run(self, name: str, call: LifecycleCall, submit: Submit) -> Outcome:
        if call.op == "wake_up":
            return await self._coalesced_wake(name, call, submit)
        if call.op in GPU_OPERATIONS:
            async with self._gpus(name, call.op):
                return await submit(call)
        return await submit(call)

    # ----- the wake, with memory admission
    async def _coalesced_wake(self, name: str, call: LifecycleCall, submit: Submit) -> Outcome:
        """One swap per engine and call: identical wakes join it; it runs as a task of its own, so a client
        that hangs up does not stop a swap half-way."""
        key = (name, call.key)
        pending = self._wakes.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            pending.add_done_callback(_mark_retrieved)
            self._wakes[key] = pending
            self._engines[name].spawn(self._wake_task(name, call, submit, pending), name=f"swap:{name}")
        return await asyncio.shield(pending)

    async def _wake_task(self, name: str, call: LifecycleCall, submit: Submit, done: asyncio.Future[Outcome]) -> None:
        try:
            done.set_result(await self._wake(name, call, submit))
        except LifeguardError as exc:
            done.set_exception(exc)
        except Exception as exc:  # a bug must still end the call cleanly, never as a hang or a 500
            log.exception("swap of %s crashed", name)
            done.set_exception(LifeguardError(f"internal error while swapping {name} in: {exc!r}"))
        finally:
            self._wakes.pop((name, call.key), None)

    async def _wake(self, name: str, call: LifecycleCall, submit: Submit) -> Outcome:
        engine = self._engines[name]
        started = time.monotonic()
        waiting_since = engine.oldest_held_since
        try:
            await self._neighbours_turn(engine, call)
            self._waits[name] = _Wait("its GPUs, behind earlier swaps or weight loads")
            async with self._gpus(name, "wake_up"):
                if engine.state is not State.SLEEPING:
                    return await submit(call)  # the coordinator judges it: a no-op or a refusal
                from_full_sleep = engine.view().asleep_tags >= ALL_SLEEP_TAGS
                try:
                    await self._make_room(engine, call)
                    self._waits[name] = _Wait("its own wake")
                    before = await self._gpu.read()
                    outcome = await submit(call)
                    await self._after_wake(engine, before, measure=from_full_sleep)
                except LifeguardError as exc:
                    no_room = isinstance(exc, InsufficientGpuMemory)
                    self._metrics.swap_finished(name, "no_room" if no_room else "failed", time.monotonic() - started)
                    refusal = exc if no_room else None
                    if _out_of_memory(exc):
                        engine.footprint.forget_measure()
                        refusal = InsufficientGpuMemory(f"engine {name} ran out of GPU memory waking up: {exc.message}")
                    if refusal is not None:
                        # Waiting out their deadline would not change it: the held requests get the reason now.
                        engine.refuse_held(refusal)
                    raise
                now = time.monotonic()
                self._awake_since[name] = now
                waited = now - waiting_since if waiting_since is not None else None
                self._metrics.swap_finished(name, "ok", now - started, waited=waited)
                return outcome
        finally:
            self._waits.pop(name, None)

    async def _neighbours_turn(self, engine: Engine, call: LifecycleCall) -> None:
        """Before a wake asked for by held requests, the neighbour it would put to sleep serves its turn (no GPU
        is locked meanwhile: a neighbour's own weight loads go on)."""
        waiting_since = engine.oldest_held_since
        if waiting_since is None or engine.state is not State.SLEEPING:
            return  # a wake nobody waits for (a trainer's): at once
        free = free_per_gpu(await self._gpu.read(), engine.config.gpus)
        neighbours = list(self._neighbours(engine.name, set(), await self._sleep_choices()))
        plan = plan_room(engine.config.gpus, await self._wake_need(engine, call), free, neighbours)
        if not isinstance(plan, Evict):
            return
        victim = self._engines[plan.victim]
        if victim.state is not State.RUNNING:
            return
        if victim.requests_in_flight == 0 and victim.last_activity <= waiting_since:
            return  # unused since the requests began waiting: nothing to finish
        ends = max(self._awake_since.get(victim.name, 0.0), waiting_since) + self._settings.swap_quantum_s
        self._waits[engine.name] = _Wait(f"{victim.name} serves its turn", until=ends)
        # The turn is for what it serves: it ends early once nothing is in flight and nothing new came for a
        # moment (its clients may all be waiting for this very swap: the bench's closed-loop clients did).
        while (left := ends - time.monotonic()) > 0:
            if victim.requests_in_flight == 0 and time.monotonic() - victim.last_activity >= _TURN_IDLE_S:
                return
            await asyncio.sleep(min(left, _TURN_IDLE_S))

    async def _make_room(self, engine: Engine, call: LifecycleCall) -> None:
        name, gpus = engine.name, engine.config.gpus
        tried: set[str] = set()
        refused: list[str] = []
        need = await self._wake_need(engine, call)  # it sleeps on, its GPUs locked: only the others change
        while True:
            free = free_per_gpu(await self._gpu.read(), gpus)
            sleep = await self._sleep_choices()
            plan = plan_room(gpus, need, free, list(self._neighbours(name, tried, sleep)))
            if isinstance(plan, Fits):
                if refused and (need is None or free is None):
                    # Without numbers the wake was to follow only once every engine there slept.
                    raise InsufficientGpuMemory(
                        f"engine {name} cannot be woken: its footprint is not known and {', '.join(refused)} "
                        "could not be put to sleep to make room"
                    )
                return
            if not isinstance(plan, Evict):
                raise InsufficientGpuMemory(f"engine {name} cannot be woken: {plan.why}")
            tried.add(plan.victim)
            if (short := sleep[plan.victim].short) is not None:
                log.warning("%s is put to sleep at level 2, not 1, to make room for %s: %s; its weights are reloaded "
                            "at its wake", plan.victim, name, short, extra={"event": "swap_level_2_host_memory",
                            "engine": plan.victim})  # fmt: skip
            if not await self._swap_out(self._engines[plan.victim], plan.level, for_engine=name):
                refused.append(plan.victim)

    async def _swap_out(self, victim: Engine, level: int, *, for_engine: str) -> bool:
        """`victim` drained (new requests for it held, what it serves finished) and put to sleep."""
        try:
            if victim.state is State.RUNNING:
                victim.swap_out(for_engine)
                self._waits[for_engine] = _Wait(f"{victim.name} finishes what it serves")
                timeout = self._settings.swap_drain_timeout_s
                if not await self._drained(victim, timeout):
                    log.warning(
                        "%s still served %d request(s) after %g s of draining for %s; its sleep ends them",
                        victim.name,
                        victim.requests_in_flight,
                        timeout,
                        for_engine,
                        extra={"event": "swap_drain_timeout", "engine": victim.name, "for_engine": for_engine},
                    )
            self._waits[for_engine] = _Wait(f"{victim.name} falling asleep")
            return await self._put_to_sleep(victim, level, for_engine=for_engine)
        finally:
            victim.swap_out(None)

    async def _drained(self, victim: Engine, timeout_s: float) -> bool:
        """Whether what `victim` serves finished within `timeout_s`, or it left RUNNING meanwhile: a trainer's sleep
        or pause in mode keep freezes what it serves inside vLLM until a wake or a resume that this swap, holding
        the GPUs, would keep waiting (chaos seed 2096); the sleep that follows ends those requests instead."""
        moved_on = victim.next_state_change()
        idle = victim.spawn(victim.wait_idle(timeout_s), name=f"drain:{victim.name}")
        left = victim.spawn(moved_on.wait(), name=f"drain:{victim.name}:state")
        try:
            await asyncio.wait({idle, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            idle.cancel()
        return moved_on.is_set() or (idle.done() and not idle.cancelled() and idle.result())

    async def _put_to_sleep(self, victim: Engine, level: int, *, for_engine: str) -> bool:
        call = LifecycleCall("sleep", (("level", str(level)), ("mode", "abort")), level=level, mode="abort")
        if level == 2:
            # Said before the sleep: requests held for it ask for its wake as it settles asleep, and the wake
            # policy wakes discarded weights only when they are reloaded after the wake.
            self.reload_on_wake.add(victim.name)
        failure: LifeguardError | None = None
        # Twice at most: a trainer's level-0 sleep may land between the plan and this sleep (chaos seed 11).
        for _ in range(2):
            try:
                if victim.view().asleep_tags == {"scheduling"}:
                    # Asleep at level 0 it holds all its memory, and a sleep at another level is refused until
                    # it wakes; the wake adds nothing (this GPU's lock is held: no other wake runs meanwhile).
                    await victim.submit_unguarded(LifecycleCall("wake_up", ()))
                await victim.submit_unguarded(call)
                failure = None
            except LifeguardError as exc:
                failure = exc
            if failure is None or victim.view().asleep_tags != {"scheduling"}:
                break
        if failure is not None:
            self.reload_on_wake.discard(victim.name)
            if _residency(victim) is Residency.ASLEEP:
                return True  # asleep meanwhile by its trainer's own sleep: the room is there, its weights its own
            # Planned again without it; the wake goes on only if the rest fits.
            log.warning(
                "could not put %s to sleep to make room for %s: %s",
                victim.name,
                for_engine,
                failure.message,
                extra={"event": "swap_out_failed", "engine": victim.name, "reason": failure.reason},
            )
            return False
        log.info(
            "put %s to sleep (level %d) to make room for %s",
            victim.name,
            level,
            for_engine,
            extra={"event": "swapped_out", "engine": victim.name, "for_engine": for_engine},
        )
        if level == 1 and keeps_backups(await victim.vllm_version()):
            self._backups_kept.add(victim.name)
        else:
            self._backups_kept.discard(victim.name)
        return True

    async def _after_wake(self, engine: Engine, before: GpuReading, *, measure: bool) -> None:
        if engine.state in _NOT_AWAKE:
            return  # a partial wake: nothing to measure or reload yet
        # Only a wake from a full sleep adds the footprint; one from level 0 or a partial wake adds a part.
        if measure and engine.footprint.configured is None and engine.footprint.measured is None:
            after = await self._gpu.read()
            if before.available and after.available:
                gpus = engine.config.gpus
                engine.footprint.measured_growth(_used_on(after, gpus) - _used_on(before, gpus))
        if engine.name in self.reload_on_wake and engine.view().weights_stale is Staleness.DISCARDED:
            method = self._settings.weight_reload_rpc_methods[0]
            body = json.dumps({"method": method}).encode()
            # The reload commits a weight change: its coordinator resets the prefix cache (lifecycle/prefix_cache.py).
            await engine.submit_unguarded(LifecycleCall("collective_rpc", (), body, rpc_method=method))
        self.reload_on_wake.discard(engine.name)

    # ----- what the planner sees
    async def _wake_need(self, engine: Engine, call: LifecycleCall) -> int | None:
        view = engine.view()
        wakes = wake_targets(call, view)
        resident = None
        if wakes and view.asleep_tags != {"scheduling"}:
            # Its own reading (the simulator's file has one per engine; NVML's device totals do not).
            reading = await engine.read_memory()
            resident = reading.used_bytes if reading.available else None
        footprint = engine.footprint
        return wake_need(footprint.bytes, view.asleep_tags, wakes, awake_bytes=footprint.awake_scale, resident=resident)

    async def _sleep_choices(self) -> dict[str, SleepChoice]:
        """How each engine would be put to sleep to make room, host memory counted (host_memory.py)."""
        return choices((self._host_engine(engine) for engine in self._engines.values()), self._host_budget)

    @property
    def _host_budget(self) -> int | None:
        budget = self._settings.host_backup_budget_gib
        return int(budget * GIB) if budget is not None else None

    def _host_engine(self, engine: Engine) -> HostEngine:
        view = engine.view()
        weights = engine.config.weights_gib
        return HostEngine(
            name=engine.name,
            weights_bytes=int(weights * GIB) if weights is not None else None,
            sleep_level=engine.config.swap_sleep_level,
            fallback_to_level_2=engine.config.when_host_memory_short == "level_2",
            asleep_at_level_1=view.state is State.SLEEPING and view.sleep_level == 1 and "weights" in view.asleep_tags,
            backup_kept=engine.name in self._backups_kept and view.state is not State.SLEEPING,
        )

    def _neighbours(self, name: str, tried: set[str], sleep: dict[str, SleepChoice]) -> Iterator[Neighbour]:
        for other in self._engines.values():
            if other.name == name:
                continue
            choice = sleep[other.name]
            yield Neighbour(
                name=other.name,
                gpus=other.config.gpus,
                residency=_residency(other),
                pinned=other.config.pinned,
                # Its lock held by the reconcile loop is not busy: the sleep waits its turn on that lock.
                busy=other.view().weight_update_active or other.name in tried,
                inflight=other.requests_in_flight,
                held=other.requests_held,
                last_used=other.last_activity,
                footprint_bytes=other.footprint.bytes,
                sleep_level=choice.level,
                host_memory_short=choice.short if choice.level == 1 else None,
            )

    # ----- one call at a time per GPU
    @contextlib.asynccontextmanager
    async def _gpus(self, name: str, op: str) -> AsyncIterator[None]:
        gpus = self._engines[name].config.gpus
        turn = _Turn(name, op, gpus)
        self._turns.append(turn)
        try:
            async with self._locks.hold(name, op, gpus):
                turn.running = True
                yield
        finally:
            self._turns.remove(turn)

    # ----- /lifeguard/state
    async def snapshot(self) -> dict[str, Any]:
        reading = await self._gpu.read()
        gpus: dict[str, Any] = {}
        engines = self._engines.values()
        for index in sorted({g for engine in engines for g in engine.config.gpus}):
            on_it = [engine for engine in engines if index in engine.config.gpus]
            device = reading.devices[index] if reading.available and index < len(reading.devices) else None
            gpus[str(index)] = {
                "engines": [engine.name for engine in on_it],
                "awake": [engine.name for engine in on_it if engine.state not in _NOT_AWAKE],
                "used_bytes": device.used_bytes if device else None,
                "total_bytes": device.total_bytes if device else None,
                "free_bytes": device.total_bytes - device.used_bytes if device else None,
            }
        now = time.monotonic()
        node = self._locks.node
        return {
            **({"gpu_lock": await node.snapshot(g for e in engines for g in e.config.gpus)} if node else {}),
            "gpus": gpus,
            "gpu_reading": None if reading.available else reading.unavailable,
            "footprint_bytes": {name: engine.footprint.bytes for name, engine in self._engines.items()},
            "swap_queue": [
                {
                    "engine": t.engine,
                    "op": t.op,
                    "gpus": list(t.gpus),
                    "running": t.running,
                    "for_s": round(now - t.since, 3),
                }
                for t in self._turns
            ],
            "swap_quantum_s": self._settings.swap_quantum_s,
            "host_memory": {
                "budget_bytes": self._host_budget,
                "available_bytes": available([self._host_engine(e) for e in engines], self._host_budget),
                "backups_kept": sorted(self._backups_kept),
            },
            "waiting": {
                name: self._waiting(engine, now) for name, engine in self._engines.items() if engine.requests_held
            },
        }

    def _waiting(self, engine: Engine, now: float) -> dict[str, Any]:
        """An engine's held requests, and what the swap that would serve them waits for now."""
        oldest = engine.oldest_held_since
        wait = self._waits.get(engine.name)
        return {
            "requests": engine.requests_held,
            "oldest_wait_s": round(now - oldest, 3) if oldest is not None else None,
            "swap_waits_for": wait.what if wait is not None else None,
            "turn_left_s": round(max(wait.until - now, 0.0), 3) if wait is not None and wait.until else None,
        }


def _residency(engine: Engine) -> Residency:
    return residency(engine.state, engine.view().asleep_tags, unconfirmed=engine.asleep_holding_memory)


def _used_on(reading: GpuReading, gpus: tuple[int, ...]) -> int:
    return sum(reading.devices[g].used_bytes for g in gpus if g < len(reading.devices))


def _out_of_memory(error: LifeguardError) -> bool:
    return isinstance(error, UpstreamBadStatus) and "out of memory" in error.upstream_body.lower()


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
