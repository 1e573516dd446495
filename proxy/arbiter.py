"""`Arbiter`: several engines on shared GPUs. It stands before each engine's coordinator (the coordinator's
`guard`), so a trainer's call to one engine's base URL and a wake on request go through it alike.

* Wakes are serialized per GPU: a wake, a weight load (`collective_rpc`, the weight-update phases) or a KV
  cache release of an engine holds a lock on each of its GPUs (taken in index order, with the lifecycle
  queue deadline), so two never run at once on one GPU (vLLM #36753: two wakes at once run out of memory).
* Memory admission before a wake: `swap_rules.plan_room` says whether what the wake adds (`wake_need`:
  nothing from level 0, the rest after a partial wake, else the footprint) fits in its GPUs' free memory;
  if not, the least recently used engine there that holds its memory and may sleep (awake, paused, or
  asleep at level 0: woken first, which adds nothing) is put to sleep through its own coordinator
  (verified as any sleep; drained first when `drain_before_sleep_s` is set), and the plan is made again.
  What cannot fit is refused with 503 `insufficient_gpu_memory`, and the engine's held requests get that
  answer at once: nothing is woken into an out-of-memory.
* An engine this arbiter put to sleep at level 2 (`swap_sleep_level: 2`) gets its weights reloaded
  (`collective_rpc reload_weights`) and its prefix cache reset right after its wake, before a request runs.

The footprint of an engine is `footprint_gib`, else what its first verified wake here added to its GPUs,
else what its own memory reading says (the simulator's shared GPU file has one per engine).
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

from .calls import LifecycleCall
from .config import EngineSettings, Settings
from .coordinator import LifecycleCoordinator, Submit
from .errors import InsufficientGpuMemory, LifecycleBusy, LifeguardError, UpstreamBadStatus
from .gate import RequestGate
from .gpu import GpuMemoryReader, GpuReading
from .metrics import SwapMetrics
from .outcome import Outcome
from .rules import ALL_SLEEP_TAGS, Staleness, wake_targets
from .states import State
from .swap_rules import GIB, Evict, Fits, Neighbour, Residency, free_per_gpu, plan_room, residency, wake_need

log = logging.getLogger("lifeguard.arbiter")

#: Calls that put weights or memory onto a GPU: never at the same time as a wake there.
GPU_OPERATIONS = frozenset(
    {"collective_rpc", "start_weight_update", "update_weights", "finish_weight_update", "release_kv_cache_memory"}
)
_NOT_AWAKE = (State.SLEEPING, State.STARTING, State.FAILED)


@dataclass
class _Slot:
    config: EngineSettings
    coordinator: LifecycleCoordinator
    gate: RequestGate
    measured_bytes: int | None = None
    # Put to sleep at level 2 by this arbiter: its weights are reloaded after its next wake.
    reload_on_wake: bool = False


@dataclass
class _Turn:
    """A call waiting for (or holding) its GPUs: the swap queue in /lifeguard/state."""

    engine: str
    op: str
    gpus: tuple[int, ...]
    since: float = field(default_factory=time.monotonic)
    running: bool = False


class _Guard:
    """The coordinator's `guard` for one engine."""

    def __init__(self, arbiter: Arbiter, slot: _Slot) -> None:
        self._arbiter = arbiter
        self._slot = slot

    @property
    def reloads_discarded_weights(self) -> bool:
        return self._slot.reload_on_wake

    async def run(self, call: LifecycleCall, submit: Submit) -> Outcome:
        return await self._arbiter.run(self._slot.config.name, call, submit)


class Arbiter:
    def __init__(self, settings: Settings, gpu: GpuMemoryReader, metrics: SwapMetrics) -> None:
        self._settings = settings
        self._configs = {engine.name: engine for engine in settings.engines}
        self._gpu = gpu
        self._metrics = metrics
        self._slots: dict[str, _Slot] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._turns: list[_Turn] = []
        self._wakes: dict[tuple[str, Any], asyncio.Future[Outcome]] = {}

    def attach(self, name: str, coordinator: LifecycleCoordinator, gate: RequestGate) -> None:
        """Called by each engine's app once its coordinator exists: from then on its calls come here."""
        slot = _Slot(self._configs[name], coordinator, gate)
        self._slots[name] = slot
        coordinator.guard = _Guard(self, slot)

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
            self._slots[name].coordinator.tasks.spawn(self._wake_task(name, call, submit, pending), name=f"swap:{name}")
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
        slot = self._slots[name]
        async with self._gpus(name, "wake_up"):
            if slot.coordinator.state is not State.SLEEPING:
                return await submit(call)  # the coordinator judges it: a no-op or a refusal
            started = time.monotonic()
            from_full_sleep = slot.coordinator.record.asleep_tags >= ALL_SLEEP_TAGS
            try:
                await self._make_room(slot, call)
                before = await self._gpu.read()
                outcome = await submit(call)
                await self._after_wake(slot, before, measure=from_full_sleep)
            except LifeguardError as exc:
                no_room = isinstance(exc, InsufficientGpuMemory)
                self._metrics.swap_finished(name, "no_room" if no_room else "failed", time.monotonic() - started)
                refusal = exc if no_room else None
                if _out_of_memory(exc):
                    slot.measured_bytes = None  # an OOM proves the measure wrong: the next plan is cautious
                    refusal = InsufficientGpuMemory(f"engine {name} ran out of GPU memory waking up: {exc.message}")
                if refusal is not None:
                    # Waiting out their deadline would not change it: the held requests get the reason now.
                    slot.gate.refuse_held(refusal)
                raise
            self._metrics.swap_finished(name, "ok", time.monotonic() - started)
            return outcome

    async def _make_room(self, slot: _Slot, call: LifecycleCall) -> None:
        name, gpus = slot.config.name, slot.config.gpus
        tried: set[str] = set()
        refused: list[str] = []
        need = await self._wake_need(slot, call)  # it sleeps on, its GPUs locked: only the others change
        while True:
            free = free_per_gpu(await self._gpu.read(), gpus)
            plan = plan_room(
                gpus, need, free, list(self._neighbours(name, tried)), may_drain=self._settings.drain_before_sleep_s > 0
            )
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
            if not await self._put_to_sleep(self._slots[plan.victim], for_engine=name):
                refused.append(plan.victim)

    async def _put_to_sleep(self, victim: _Slot, *, for_engine: str) -> bool:
        level = victim.config.swap_sleep_level
        call = LifecycleCall("sleep", (("level", str(level)), ("mode", "abort")), level=level, mode="abort")
        coordinator = victim.coordinator
        failure: LifeguardError | None = None
        # Twice at most: a trainer's level-0 sleep may land between the plan and this sleep (chaos seed 11).
        for _ in range(2):
            try:
                if coordinator.record.asleep_tags == {"scheduling"}:
                    # Asleep at level 0 it holds all its memory, and a sleep at another level is refused until
                    # it wakes; the wake adds nothing (this GPU's lock is held: no other wake runs meanwhile).
                    await coordinator.submit_unguarded(LifecycleCall("wake_up", ()))
                await coordinator.submit_unguarded(call)
                failure = None
            except LifeguardError as exc:
                failure = exc
            if failure is None or coordinator.record.asleep_tags != {"scheduling"}:
                break
        if failure is not None:
            if _residency(coordinator) is Residency.ASLEEP:
                return True  # asleep meanwhile by its trainer's own sleep: the room is there, its weights its own
            # Planned again without it; the wake goes on only if the rest fits.
            log.warning(
                "could not put %s to sleep to make room for %s: %s",
                victim.config.name,
                for_engine,
                failure.message,
                extra={"event": "swap_out_failed", "engine": victim.config.name, "reason": failure.reason},
            )
            return False
        victim.reload_on_wake = level == 2
        if victim.gate.held:
            # Requests for it that arrived while it fell asleep asked for no wake (only those held while it
            # sleeps do): ask now. The wake queues behind this swap, on the same GPU lock.
            victim.gate.on_held_while_sleeping()
        log.info(
            "put %s to sleep (level %d) to make room for %s",
            victim.config.name,
            level,
            for_engine,
            extra={"event": "swapped_out", "engine": victim.config.name, "for_engine": for_engine},
        )
        return True

    async def _after_wake(self, slot: _Slot, before: GpuReading, *, measure: bool) -> None:
        coordinator = slot.coordinator
        if coordinator.state in _NOT_AWAKE:
            return  # a partial wake: nothing to measure or reload yet
        # Only a wake from a full sleep adds the footprint; one from level 0 or a partial wake adds a part.
        if measure and slot.config.footprint_gib is None and slot.measured_bytes is None:
            after = await self._gpu.read()
            grown = _used_on(after, slot.config.gpus) - _used_on(before, slot.config.gpus)
            if before.available and after.available and grown > 0:
                slot.measured_bytes = grown
        if slot.reload_on_wake and coordinator.record.weights_stale is Staleness.DISCARDED:
            method = self._settings.weight_reload_rpc_methods[0]
            body = json.dumps({"method": method}).encode()
            await coordinator.submit_unguarded(LifecycleCall("collective_rpc", (), body, rpc_method=method))
            reply = await coordinator.exclusive(
                lambda: coordinator.client.call("POST", "/reset_prefix_cache"), adapters_may_change=False
            )
            if reply.status != 200:
                log.warning("reset_prefix_cache after reloading %s answered %d", slot.config.name, reply.status)
        slot.reload_on_wake = False

    # ----- what the planner sees
    def footprint(self, name: str) -> int | None:
        slot = self._slots.get(name)
        config = self._configs[name]
        if config.footprint_gib is not None:
            return int(config.footprint_gib * GIB)
        if slot is None:
            return None
        return slot.measured_bytes or slot.coordinator.verifier.awake_footprint

    async def _wake_need(self, slot: _Slot, call: LifecycleCall) -> int | None:
        view = slot.coordinator.record.view()
        wakes = wake_targets(call, view)
        resident = None
        if wakes and view.asleep_tags != {"scheduling"}:
            # Its own reading (the simulator's file has one per engine; NVML's device totals do not).
            reading = await slot.coordinator.verifier.read_memory()
            resident = reading.used_bytes if reading.available else None
        footprint = self.footprint(slot.config.name)
        # On the scale of `resident` (its own reading), not a measure of the device's growth.
        awake = footprint if slot.config.footprint_gib is not None else slot.coordinator.verifier.awake_footprint
        return wake_need(footprint, view.asleep_tags, wakes, awake_bytes=awake, resident=resident)

    def _neighbours(self, name: str, tried: set[str]) -> Iterator[Neighbour]:
        for other in self._slots.values():
            if other.config.name == name:
                continue
            coordinator = other.coordinator
            yield Neighbour(
                name=other.config.name,
                gpus=other.config.gpus,
                residency=_residency(coordinator),
                pinned=other.config.pinned,
                # Its lock held by the reconcile loop is not busy: the sleep waits its turn on that lock.
                busy=coordinator.record.weight_update_active or other.config.name in tried,
                inflight=other.gate.inflight,
                held=other.gate.held,
                last_used=other.gate.last_activity,
                footprint_bytes=self.footprint(other.config.name),
            )

    # ----- one call at a time per GPU
    @contextlib.asynccontextmanager
    async def _gpus(self, name: str, op: str) -> AsyncIterator[None]:
        gpus = self._configs[name].gpus
        turn = _Turn(name, op, gpus)
        self._turns.append(turn)
        taken: list[asyncio.Lock] = []
        try:
            try:
                async with asyncio.timeout(self._settings.lifecycle_queue_timeout_s):
                    for index in sorted(gpus):
                        lock = self._locks.setdefault(index, asyncio.Lock())
                        await lock.acquire()
                        taken.append(lock)
            except TimeoutError:
                raise LifecycleBusy(
                    f"GPU {list(gpus)} stayed busy with other engines' wakes or weight loads for "
                    f"{self._settings.lifecycle_queue_timeout_s:g} s"
                ) from None
            turn.running = True
            yield
        finally:
            for lock in reversed(taken):
                lock.release()
            self._turns.remove(turn)

    # ----- /lifeguard/state
    async def snapshot(self) -> dict[str, Any]:
        reading = await self._gpu.read()
        gpus: dict[str, Any] = {}
        for index in sorted({g for config in self._configs.values() for g in config.gpus}):
            on_it = [config.name for config in self._configs.values() if index in config.gpus]
            device = reading.devices[index] if reading.available and index < len(reading.devices) else None
            gpus[str(index)] = {
                "engines": on_it,
                "awake": [n for n in on_it if n in self._slots and self._slots[n].coordinator.state not in _NOT_AWAKE],
                "used_bytes": device.used_bytes if device else None,
                "total_bytes": device.total_bytes if device else None,
                "free_bytes": device.total_bytes - device.used_bytes if device else None,
            }
        now = time.monotonic()
        return {
            "gpus": gpus,
            "gpu_reading": None if reading.available else reading.unavailable,
            "footprint_bytes": {name: self.footprint(name) for name in self._configs},
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
        }


def _residency(coordinator: LifecycleCoordinator) -> Residency:
    view = coordinator.record.view()
    verifier = coordinator.verifier
    # A sleep known from vLLM's gauge alone is unconfirmed too; only a reading that shows the awake footprint
    # still there says it kept its memory (else every engine found asleep at the proxy's start would).
    kept = (
        view.sleep_unconfirmed
        and verifier.last_memory is not None
        and verifier.memory_freed(verifier.last_memory) is False
    )
    return residency(coordinator.state, view.asleep_tags, unconfirmed=kept)


def _used_on(reading: GpuReading, gpus: tuple[int, ...]) -> int:
    return sum(reading.devices[g].used_bytes for g in gpus if g < len(reading.devices))


def _out_of_memory(error: LifeguardError) -> bool:
    return isinstance(error, UpstreamBadStatus) and "out of memory" in error.upstream_body.lower()


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
