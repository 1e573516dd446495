"""The engine model, with no HTTP: sleep tags, pause state, weights, faults, counters, violations.

It follows vLLM 0.32 as measured (docs/real-vllm.md, and the conformance suite run against a real vLLM)
and as read in its source (``vllm/v1/engine/core.py``, ``vllm/entrypoints/serve/dev/``):

* ``is_sleeping`` = the scheduler is paused OR the executor holds a sleeping tag, so it is also true
  after a plain ``/pause``.
* ``/sleep`` pauses the scheduler with its ``mode`` first, then sleeps the executor unless it already
  sleeps; a repeat therefore aborts what queued meanwhile and frees nothing.
* ``/wake_up`` wakes the named executor tags and resumes the scheduler only once none is left asleep;
  so it also lifts a plain ``/pause``.
* ``/resume`` un-pauses even while asleep. That is vLLM's hazard, and the simulator records it.

Where releases differ (``--vllm-version``), ``self.profile`` says how (lifeguard_sim/versions.py): on 0.33 a
``/pause?mode=abort|wait`` also refuses new requests until the scheduler resumes, a scale-down of elastic EP can
retire this rank, and the engine-death message is sanitised.

Breaches of engine safety go to ``violations``: the proxy's end-to-end tests assert it stays empty.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import cast

from lifeguard_sim import errors
from lifeguard_sim.checkpoint import NEEDS_AWAKE, NEEDS_SLEEP_MODE, Checkpoint, CheckpointState
from lifeguard_sim.errors import EngineGone
from lifeguard_sim.fault_tolerance import FaultTolerance
from lifeguard_sim.faults import FaultBook, Fired
from lifeguard_sim.memory import MEMORY_TAGS, DeviceMemory, make_memory, write_gpu_file
from lifeguard_sim.prefix_cache import PrefixCache
from lifeguard_sim.scheduler import PauseState, Scheduler, SimRequest, spans
from lifeguard_sim.settings import SimSettings
from lifeguard_sim.shared_gpu import SharedGpuFile
from lifeguard_sim.versions import profile

_ALL_TAGS = frozenset(MEMORY_TAGS)
# The /collective_rpc methods of SkyRL's worker extension (skyrl/backends/skyrl_train/inference_servers/):
# 0.3.0's weight push, and 0.4.0's NewInferenceWorkerWrap (the push itself moved to vLLM's native routes).
SKYRL_WORKER_RPCS = frozenset(
    {
        "skyrl_start_weight_update",
        "update_weights_ipc",
        "update_weights_nccl",
        "skyrl_finish_weight_update",
        "fetch_weights",
        "skyrl_sleep_for_weight_sync",
        "skyrl_wake_for_weight_sync",
        "skyrl_set_lora_receive_target",
        "skyrl_discard_in_memory_lora",
    }
)
# SkyRL's marker path for an adapter built from tensors a weight update staged (weight_sync/lora_target.py).
IN_MEMORY_LORA_PREFIX = "skyrl-memory://"
_AWAKE_METRIC = (1, 0, 0)
# vLLM's /pause handler sleeps 20 ms after the engine acknowledges, to let outputs flush.
_PAUSE_FLUSH_SECONDS = 0.02


class Engine:
    def __init__(self, settings: SimSettings, on_gone: Callable[[str], None] = lambda _why: None) -> None:
        if (problem := settings.problem()) is not None:
            raise ValueError(problem)
        self.settings = settings
        self.profile = profile(settings.vllm_version)
        self.faults = FaultBook(settings.seed, settings.faults)
        self.memory: DeviceMemory = make_memory(
            settings.memory,
            weights_gib=settings.weights_gib,
            kv_gib=settings.kv_gib,
            overhead_gib=settings.overhead_gib,
            total_gib=settings.total_gib,
            keep_backups=self.profile.keeps_host_backups,
        )
        self.scheduler = Scheduler()
        self.counters: Counter[str] = Counter()
        self.violations: list[dict[str, object]] = []
        self._on_gone = on_gone
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._watchdog: asyncio.TimerHandle | None = None
        self._ft_deadline: asyncio.TimerHandle | None = None
        self._gpu_file = Path(settings.gpu_file) if settings.gpu_file else None
        self._shared = None
        if self._gpu_file is not None and settings.gpu_file_engine:
            self._shared = SharedGpuFile(
                self._gpu_file, settings.gpu_file_engine, self.memory.total_bytes, tuple(settings.gpu_uuids)
            )
        self._written: dict[str, object] | None = None
        self.death_reason: str | None = None
        # Told of every generation request's end (the chaos journal's `answer` lines): which weights produced it.
        self.on_answer: Callable[[dict[str, object]], None] | None = None
        self._epoch = 0
        self._set_fresh_state()

    def _set_fresh_state(self) -> None:
        self.executor_tags: set[str] = set()
        self.scheduling_asleep = False  # a level-0 sleep: only the scheduler sleeps
        self.sleep_level: int | None = None
        self.weights_valid = True
        # What /weight_checker's digests see (lifeguard_sim/weight_checker.py) besides the weights written: zeroed by a
        # reset, and whether a lie-weights fault gave one tensor other bytes.
        self.weights_zeroed = False
        self.weights_altered = False
        self.offload_altered = False  # a lie-weights sleep: the CPU copy of the weights holds other bytes
        self.weight_update_active = False
        self.weight_update_draft = False  # the open session writes the drafter (/start_draft_weight_update)
        self.draft_weight_writes = 0
        self.weight_transfer_initialized = False
        # SkyRL 0.4.0's worker extension: pools its allocator sleep freed behind the executor, checkpoint-delta
        # versions fetched to disk, the LoRA adapter the next round builds, and adapters staged by such rounds.
        self.worker_asleep: set[str] = set()
        self.fetched_versions: set[int] = set()
        self.lora_round_target: str | None = None
        self.staged_adapters: set[str] = set()
        # fp8_kv_cache: the attention layers' _q_scale was lost with discarded weights (a broadcast does not carry it).
        self.q_scale_lost = False
        self.weight_version = "default"
        # A failed /update_weights chunk left parameters on the meta device or half written ("340 / 340 tensors on
        # meta"): the next model step kills the engine, until a finished session or a reload replaces them (the
        # `partial` fault; vLLM PR #57854 is not in 0.34).
        self.weights_partial = False
        # A stall behind a healthy /health (the `stall:S` fault): no request steps until this time.monotonic().
        self.stalled_until = 0.0
        # A new process starts with an empty prefix cache, and an empty CPU offload tier (an SSD tier could outlive
        # it; not modelled).
        self.offload_tier = PrefixCache(self.settings.block_size) if self.settings.kv_connector else None
        self.prefix_cache = PrefixCache(self.settings.block_size, lower=self.offload_tier)
        self.weights_committed_at = 0.0  # time.time() of the last answered weight change (finish, reload)
        self.weight_writes = 0  # /update_weights applied since the start: 0 is the initial checkpoint
        self.garbage = False
        self.lora_adapters: dict[str, str] = {}  # name -> path; a restarted vLLM has none
        # Adapters still listed whose weights a wake lost (vLLM #53888): they answer like the base model.
        self.lora_lost: set[str] = set()
        # vLLM 0.33's EngineCoreProc.reject_new_requests: set by a user pause in abort or wait mode.
        self.reject_new_requests = False
        # Elastic EP (serve/elastic_ep/): the middleware's two process-local flags and the status store's view.
        self.dp_size = self.settings.data_parallel_size
        self.elastic_scaling = False
        self.elastic_retired = False
        self.elastic_phase = "idle"
        self.elastic_epoch: int | None = None
        self.elastic_error: str | None = None
        self.elastic_requested: int | None = None
        # Cleared while a trainer's server wrapper holds generation before the engine (AReaL's pause).
        self.trainer_gate = asyncio.Event()
        self.trainer_gate.set()
        self.errored = False
        self.wedged: set[str] = set()
        self.sleep_metric = _AWAKE_METRIC
        # Pools a sleep freed whose 500 (the freed-500 fault) kept the executor from recording them asleep.
        self.sleep_unrecorded: set[str] = set()
        self.checkpoint = Checkpoint()
        s = self.settings
        self.ft = FaultTolerance(s.enable_fault_tolerance, s.data_parallel_size, s.data_parallel_rank)
        self.memory.reset()
        if s.checkpoint_prepare_on_startup:
            # EngineCoreProc's startup: checkpoint_prepare() in wait mode on an idle engine completes at once.
            self.checkpoint.state = CheckpointState.PREPARING
            self.reject_new_requests = True
            self.scheduler.set_pause("wait")
            self._release_for_checkpoint()

    @property
    def text_seed(self) -> str:
        """What greedy answers depend on: the model, and the weights written since the initial checkpoint
        (a restarted vLLM answers like the checkpoint again, not like the trained weights)."""
        seed = str(self.settings.seed)
        return seed if not self.weight_writes else f"{seed}+{self.weight_writes}"

    @property
    def weights_held(self) -> str:
        """What the weights are, as /weight_checker's digests see them (lifeguard_sim/weight_checker.py)."""
        if self.weights_zeroed:
            return "zeros"
        if self.weights_partial:
            return f"partial:{self.text_seed}"
        if not self.weights_valid:
            return f"discarded:{self._epoch}"
        return self.text_seed

    # --- observation
    @property
    def dead(self) -> bool:
        return self.errored or self.scheduler.gone

    @property
    def asleep_tags(self) -> set[str]:
        return self.executor_tags | ({"scheduling"} if self.scheduling_asleep else set())

    @property
    def memory_asleep(self) -> set[str]:
        """Pools not mapped: asleep through vLLM's executor, or freed behind it (SkyRL's worker extension, a sleep
        that answered 500 after freeing)."""
        return self.executor_tags | self.worker_asleep | self.sleep_unrecorded

    @property
    def is_paused(self) -> bool:
        return self.scheduler.pause_state is not PauseState.UNPAUSED

    @property
    def is_sleeping(self) -> bool:
        return self.is_paused or bool(self.executor_tags)

    def model_seed(self, model: str) -> str:
        """What a greedy answer of `model` (the base model or a LoRA adapter) depends on: an adapter answers
        otherwise than the base model, unless a wake lost its weights."""
        path = self.lora_adapters.get(model)
        if path is None or model in self.lora_lost:
            return self.text_seed
        return f"{self.text_seed}|lora:{model}:{path}"

    def elastic_gate(self, path: str) -> str | None:
        """The message of the elastic-EP middleware's 503 for `path`, or None when it passes."""
        if not (self.elastic_scaling or self.elastic_retired):
            return None
        if self.profile.health_passes_elastic_gate and path in ("/health", "/is_scaling_elastic_ep"):
            return None
        return errors.RETIRED_MESSAGE if self.elastic_retired else errors.SCALING_MESSAGE

    def elastic_status(self) -> dict[str, object]:
        """`/is_scaling_elastic_ep`'s body."""
        if not self.profile.elastic_status_fields:
            return {"is_scaling_elastic_ep": self.elastic_scaling}
        scaling = self.elastic_phase in ("preparing", "committing")
        return {
            "is_scaling_elastic_ep": scaling,
            "phase": self.elastic_phase,
            "epoch": self.elastic_epoch,
            "error": self.elastic_error,
            "requested_data_parallel_size": self.elastic_requested,
        }

    def state_dict(self) -> dict[str, object]:
        return {
            "vllm_version": self.profile.version,
            "asleep_tags": sorted(self.asleep_tags),
            "sleep_level": self.sleep_level,
            "is_sleeping": self.is_sleeping,
            "paused": self.is_paused,
            "pause_state": self.scheduler.pause_state.value,
            "dead": self.dead,
            "errored": self.errored,
            "process_gone": self.scheduler.gone,
            "weights_valid": self.weights_valid,
            "weight_update_active": self.weight_update_active,
            "weight_update_draft": self.weight_update_draft,
            "draft_weight_writes": self.draft_weight_writes,
            "worker_asleep": sorted(self.worker_asleep),
            "fetched_versions": sorted(self.fetched_versions),
            "staged_adapters": sorted(self.staged_adapters),
            "q_scale_lost": self.q_scale_lost,
            "weight_version": self.weight_version,
            "weight_writes": self.weight_writes,
            "weights_partial": self.weights_partial,
            "sleep_unrecorded": sorted(self.sleep_unrecorded),
            "checkpoint": self.checkpoint.body(),
            "fault_tolerance": dict(self.ft.entry) if self.ft.enabled else None,
            "stalled": self.stalled,
            "prefix_cache_blocks": len(self.prefix_cache),
            "offload_tier_blocks": None if self.offload_tier is None else len(self.offload_tier),
            "garbage": self.garbage,
            "reject_new_requests": self.reject_new_requests,
            "lora_adapters": dict(sorted(self.lora_adapters.items())),
            "lora_lost": sorted(self.lora_lost),
            "elastic_ep": {
                "scaling": self.elastic_scaling,
                "retired": self.elastic_retired,
                "data_parallel_size": self.dp_size,
                "data_parallel_rank": self.settings.data_parallel_rank,
                **self.elastic_status(),
            },
            "wedged": sorted(self.wedged),
            "memory": {
                "used_bytes": self.memory.used_bytes,
                "total_bytes": self.memory.total_bytes,
                "resident": sorted(self.memory.resident),
                "host_bytes": self.memory.host_bytes,
            },
            "counters": dict(sorted(self.counters.items())),
            "running": self.scheduler.running,
            "waiting": self.scheduler.waiting,
            "violations": list(self.violations),
            "faults": self.faults.active(),
        }

    def check_health(self) -> bool:
        if self.scheduler.gone:
            raise EngineGone
        # vLLM 0.33 AsyncLLM.check_health returns before looking at the engine on a retired rank.
        return self.elastic_retired or not self.errored

    # --- control of the simulated process
    def set_faults(self, specs: list[str]) -> None:
        self.faults.replace(specs)

    def publish(self) -> None:
        """Write the GPU file when memory moved (and once at start)."""
        snapshot = self.memory.snapshot()
        if self._gpu_file is not None and snapshot != self._written:
            if self._shared is not None:
                self._shared.publish(snapshot)
            else:
                write_gpu_file(self._gpu_file, snapshot)
            self._written = snapshot

    def _reserve(self, added: int) -> bool:
        """Take ``added`` bytes more on the shared device now, in the same locked step as the check that they
        fit: vLLM allocates as it wakes, so another engine's claim during the wake's duration must find them
        gone (seed 5 of the two-engine chaos run: a check, the wake's sleep, then the publish let a restart's
        claim in between, 100 of 80 GiB). False: no room, nothing taken."""
        assert self._shared is not None
        used = self.memory.used_bytes + added
        snapshot = self.memory.snapshot()
        devices = cast(list[dict[str, object]], snapshot["devices"])
        own = {**snapshot, "used_bytes": used, "devices": [{**device, "used_bytes": used} for device in devices]}
        if self._shared.claim(own) is None:
            return False
        self._written = own
        return True

    async def _move(self, move: Callable[[], bool]) -> None:
        """Real device memory moves off the event loop: vLLM's API server answers /health meanwhile."""
        if self.memory.blocking:
            await asyncio.to_thread(move)
        else:
            move()

    def die(self, reason: str) -> None:
        """The process ends: every connection resets. In-process the app keeps resetting until restart."""
        if self.scheduler.gone:
            return
        self.death_reason = reason
        self._cancel_watchdog()
        self._epoch += 1
        self.scheduler.gone = True
        self.scheduler.notify()
        self._on_gone(reason)

    def restart(self) -> None:
        """A fresh process: awake, unpaused, initial weights; counters and violations are kept."""
        self._cancel_watchdog()
        self._epoch += 1
        self.scheduler.reset()
        self._set_fresh_state()
        self.death_reason = None
        self.counters["restart"] += 1
        self.publish()

    def shutdown(self) -> None:
        """App shutdown: hung calls and held requests stop waiting so teardown never blocks."""
        self._cancel_watchdog()
        self._stopping.set()
        self.scheduler.gone = True
        self.scheduler.notify()

    def _cancel_watchdog(self) -> None:
        """Stop the old process's timers: the watchdog and the fault-tolerance deadline."""
        for timer in (self._watchdog, self._ft_deadline):
            if timer is not None:
                timer.cancel()
        self._watchdog = self._ft_deadline = None

    def violate(self, kind: str, detail: str, **extra: object) -> None:
        self.violations.append({"kind": kind, "detail": detail, "at": time.time(), **extra})

    # --- the fault-aware frame every operation runs in
    async def enter(self, op: str, nominal_seconds: float = 0.0) -> Fired:
        self.counters[op] += 1
        self.check_alive()
        if op != "generate" and self.ft.waiting:
            # A faulted busy loop takes no utility call until it is told to recover (or dies).
            await self.scheduler.until(lambda: not self.ft.waiting or self.errored)
            self.check_alive()
        if op in self.wedged:
            raise errors.out_of_memory(op)
        fired = self.faults.draw(op)
        if fired.extra_seconds:
            await asyncio.sleep(fired.extra_seconds)
        if fired.kind in ("error500", "wedge"):
            if fired.kind == "wedge":
                self.wedged.add(op)
            raise errors.out_of_memory(op)
        if fired.kind == "hang":
            epoch = self._epoch
            await self.scheduler.until(lambda: self._stopping.is_set() or self._epoch != epoch)
            raise EngineGone
        if fired.kind == "crash" and op != "generate":
            await asyncio.sleep(nominal_seconds / 2)
            self.die(f"crash fault during {op}")
            raise EngineGone
        return fired

    def after(self, fired: Fired) -> None:
        if fired.kind == "garbage":
            self.garbage = True
        elif fired.kind == "lie-dead":
            self.fail()
        self.publish()

    def fail(self) -> None:
        """The engine core died (EngineDeadError): /health 503, every call 500, and vLLM's API server exits on its
        watchdog's next tick."""
        if self.errored:
            return
        self.errored = True
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self.settings.watchdog_seconds, self.die, "watchdog: engine core died")

    @property
    def stalled(self) -> bool:
        return time.monotonic() < self.stalled_until

    def check_step(self) -> None:
        """A model step of a running request: EngineDeadError instead of a token when the engine died, or when this
        step kills it (partial weights: the forward pass meets parameters on the meta device; weights a failed sleep
        unmapped behind the executor: an illegal memory access)."""
        if self.weights_partial or "weights" in self.sleep_unrecorded:
            self.fail()
        if self.errored:
            raise errors.engine_dead(self.profile.engine_dead_message)

    def core_fault(self) -> None:
        """The engine core's busy loop raised (the engine-fault fault). Without fault tolerance the engine dies; with
        it every request is aborted and the loop waits for a recovery instruction, dying after the timeout."""
        if not self.ft.enabled:
            self.fail()
            return
        self.ft.on_fault("RuntimeError")
        self.scheduler.abort()
        loop = asyncio.get_running_loop()
        self._ft_deadline = loop.call_later(self.settings.ft_recovery_seconds, self._ft_timed_out)

    def _ft_timed_out(self) -> None:
        if self.ft.waiting:
            self.ft.on_timeout()
            self.fail()
            self.scheduler.notify()

    def fault_tolerance_apply(self, instruction: str, params: dict[str, object], request_id: str) -> None:
        """A recovery round, run after the route's 202 (a background task in vLLM)."""
        self.counters["fault_tolerance_apply"] += 1
        if self.ft.apply(instruction, params, request_id) is None and self._ft_deadline is not None:
            self._ft_deadline.cancel()
            self._ft_deadline = None
        self.scheduler.notify()

    def answered(self, req: SimRequest) -> None:
        """A generation request ended: tell `on_answer` which weight-version labels and which weights produced it."""
        if self.on_answer is not None:
            self.on_answer(
                {
                    "request_id": req.request_id,
                    "external_id": req.external_id,
                    "finish_reason": req.finish_reason,
                    "tokens": req.produced,
                    "weight_versions": spans(req.version_starts, req.produced),
                    "weights": spans(req.weights_starts, req.produced, key="weights"),
                }
            )

    def check_alive(self) -> None:
        if self.scheduler.gone:
            raise EngineGone
        if self.errored:
            raise errors.engine_dead(self.profile.engine_dead_message)

    def _refuse_in_checkpoint(self, op: str, action: str) -> None:
        """vLLM 0.34's checkpoint guards in EngineCore.sleep / wake_up, through the utility call's failure."""
        if (why := self.checkpoint.refusal(action)) is not None:
            raise errors.method_failed(op, why)

    def reset_caches(self, *, reset_connector: bool) -> None:
        """EngineCore._reset_caches: the prefix cache (running requests preempted), and the KV connector's offload tier
        when `reset_connector`. The simulator keeps a frozen request's blocks (see docs/simulator.md)."""
        if self.scheduler.running == 0:
            self.prefix_cache.reset()
        if reset_connector and self.offload_tier is not None:
            self.offload_tier.reset()

    # --- sleep family
    async def sleep(self, level: int, mode: str, reset_connector: bool = True) -> dict[str, object]:
        fired = await self.enter("sleep", self.settings.sleep_seconds)
        self._refuse_in_checkpoint("sleep", "sleep")
        started = time.monotonic()
        if fired.kind != "lie-asleep":
            await self.scheduler.pause(mode)
            if level >= 1:  # EngineCore.sleep pauses with clear_cache for a level >= 1
                self.reset_caches(reset_connector=reset_connector)
            async with self._lock:
                if not self.executor_tags and level == 0:
                    self.scheduling_asleep = True
                    self.sleep_level = 0
                elif not self.executor_tags:
                    await asyncio.sleep(self.settings.sleep_seconds)
                    if level >= 2:
                        self.weights_valid = False
                        self.q_scale_lost = self.settings.fp8_kv_cache
                    if self.settings.sleep_mode and fired.kind != "lie-memory":
                        # Level 1 offloads the weights to CPU memory; level 2 discards them.
                        offload = {"weights"} if level == 1 else set()
                        await self._move(lambda: self.memory.release(_ALL_TAGS, offload=offload))
                    if fired.kind == "freed-500":
                        # Worker.sleep suspended the pools, then its assertion that the device's free memory did not
                        # shrink tripped; Executor.sleep sets its sleeping tags only after the call returns, so it
                        # never does (v1/worker/gpu_worker.py, v1/executor/abstract.py). The gauge stays awake.
                        self.sleep_unrecorded = set(_ALL_TAGS)
                        self.publish()
                        raise errors.method_failed("sleep", "Memory usage increased after sleeping.")
                    self.executor_tags = set(_ALL_TAGS)
                    self.sleep_unrecorded = set()  # a sleep sent again after a freed-500 records them
                    self.scheduling_asleep = False
                    self.sleep_level = level
                    self.offload_altered = fired.kind == "lie-weights" and level == 1
        # vLLM re-records the gauge with the requested level even when the executor was already asleep.
        self.sleep_metric = (0, int(level == 1), int(level == 2))
        self.scheduler.stats.durations["sleep"].append(time.monotonic() - started)
        self.after(fired)
        return {"status": "sleeping", "level": level}

    async def wake_up(self, tags: list[str] | None) -> dict[str, object]:
        fired = await self.enter("wake_up", self.settings.wake_seconds)
        self._refuse_in_checkpoint("wake_up", "wake up")
        started = time.monotonic()
        if fired.kind == "lie-asleep":
            await asyncio.sleep(self.settings.wake_seconds)
            claimed = "awake"
        else:
            if self.worker_asleep or self.sleep_unrecorded:
                freed = sorted(self.worker_asleep | self.sleep_unrecorded)
                self.violate("wake_up_while_worker_asleep", f"/wake_up resumed scheduling with {freed} freed")
            async with self._lock:
                wanted = set(self.executor_tags) if tags is None else set(tags) - {"scheduling"}
                # Executor.wake_up is all or nothing: one tag that is not asleep makes the call a no-op.
                to_wake = wanted if wanted <= self.executor_tags else set()
                if to_wake and self._shared and not self._reserve(self.memory.added_by(to_wake)):
                    if self.settings.oom_wedges:  # as in the field report: every later wake fails too
                        self.wedged.add("wake_up")
                    raise errors.out_of_memory("wake_up")  # the device is full: vLLM's OOM, and the engine stays asleep
                if to_wake:
                    try:
                        await asyncio.sleep(self.settings.wake_seconds)
                        self.executor_tags -= to_wake
                        if fired.kind != "lie-memory":
                            await self._move(lambda: self.memory.restore(to_wake))
                    finally:
                        self.publish()  # a wake cut short (or a lying one) gives back what it reserved
                if not self.executor_tags:
                    self.sleep_level = None
                    self.scheduling_asleep = False
                    self._resume_scheduler()
                if fired.kind == "lose-lora" and "weights" in to_wake:
                    self.lora_lost |= set(self.lora_adapters)  # vLLM #53888: still listed, base-model answers
                if (fired.kind == "lie-weights" or self.offload_altered) and "weights" in to_wake:
                    self.weights_altered = True  # other bytes than were put to sleep
                    self.offload_altered = False
            claimed = "sleeping" if self.is_sleeping else "awake"
        # vLLM 0.32's AsyncLLM.wake_up records "awake" only once the executor is fully awake (measured).
        if fired.kind == "lie-asleep" or not self.executor_tags:
            self.sleep_metric = _AWAKE_METRIC
        self.scheduler.stats.durations["wake"].append(time.monotonic() - started)
        self.after(fired)
        return {"status": claimed, "tags": tags}

    async def release_kv_cache_memory(self, reset_connector: bool = True) -> dict[str, object]:
        """vLLM 0.32's EngineCore.release_kv_cache_memory: from a completed pause, reset the caches (the KV connector's
        too, unless 0.34's `reset_connector` is false) and discard the KV cache only; AsyncLLM then records the
        sleep-state gauge as asleep at no level (awake 0, both levels 0)."""
        fired = await self.enter("release_kv_cache_memory")
        if fired.kind != "lie-asleep":
            if not self.is_paused or self.scheduler.requests:
                raise errors.method_failed(
                    "release_kv_cache_memory", "release_kv_cache_memory() requires a completed pause first"
                )
            if self.executor_tags:
                raise errors.method_failed(
                    "release_kv_cache_memory",
                    "release_kv_cache_memory() requires all executor memory to be resident",
                )
            self.reset_caches(reset_connector=reset_connector)
            self.executor_tags = {"kv_cache"}
            if self.settings.sleep_mode and fired.kind != "lie-memory":
                await self._move(lambda: self.memory.release({"kv_cache"}))
        self.sleep_metric = (0, 0, 0)
        self.after(fired)
        return {"status": "kv_cache_released"}

    # --- the checkpoint lifecycle (vLLM 0.34, lifeguard_sim/checkpoint.py)
    async def checkpoint_prepare(self, mode: str) -> str | None:
        """EngineCoreProc.checkpoint_prepare, from RUNNING: None once started (the drain may go on, the state is then
        PREPARING), or why it cannot start, nothing changed."""
        fired = await self.enter("checkpoint_prepare")
        if fired.kind == "lie-asleep":
            return None
        if not self.settings.sleep_mode:
            return NEEDS_SLEEP_MODE
        if self.executor_tags:
            return NEEDS_AWAKE
        self.checkpoint.state = CheckpointState.PREPARING
        self.reject_new_requests = mode != "keep"  # pause_generation(mode, clear_cache=False)
        self.scheduler.set_pause(mode)
        if self.scheduler.drained:
            self._finish_prepare(fired)
        else:  # PREPARING until the last running request ends
            self.scheduler.on_drained.append(lambda: self._finish_prepare(fired))
        return None

    def _finish_prepare(self, fired: Fired) -> None:
        """_finish_pause for a checkpoint: release_kv_cache_memory(), then the workers' communicators."""
        if fired.kind == "checkpoint-fails":
            self.checkpoint.fail(errors.OOM_MESSAGE)
        else:
            self._release_for_checkpoint()
        self.after(fired)

    def _release_for_checkpoint(self) -> None:
        self.reset_caches(reset_connector=True)
        self.executor_tags |= {"kv_cache"}
        if self.settings.sleep_mode:
            self.memory.release({"kv_cache"})
        self.checkpoint.state = CheckpointState.PREPARED

    async def checkpoint_restore(self) -> None:
        """EngineCoreProc.checkpoint_restore, from PREPARED: the workers' communicators, then wake_up(["kv_cache"]),
        whose resume makes the state RUNNING. A failure (a wake out of memory on a shared device included) is FAILED
        and raised."""
        fired = await self.enter("checkpoint_restore", self.settings.wake_seconds)
        if fired.kind == "lie-asleep" or self.checkpoint.state is not CheckpointState.PREPARED:
            return
        self.checkpoint.state = CheckpointState.RESTORING
        try:
            if fired.kind == "checkpoint-fails":
                raise errors.method_failed("checkpoint_restore", errors.OOM_MESSAGE)
            async with self._lock:
                added = self.memory.added_by({"kv_cache"})
                if "kv_cache" in self.executor_tags and self._shared and not self._reserve(added):
                    raise errors.out_of_memory("checkpoint_restore")
                await asyncio.sleep(self.settings.wake_seconds)
                self.executor_tags -= {"kv_cache"}
                await self._move(lambda: self.memory.restore({"kv_cache"}))
                self.publish()
        except errors.EngineHTTPError as exc:
            self.checkpoint.fail(errors.OOM_MESSAGE)
            self.publish()
            raise exc
        if not self.executor_tags:
            self.sleep_level = None
            self.scheduling_asleep = False
            self._resume_scheduler()
        self.after(fired)

    # --- pause family
    async def pause(self, mode: str) -> dict[str, object]:
        fired = await self.enter("pause")
        if fired.kind != "lie-asleep":
            if self.profile.pause_rejects:  # set as the pause starts, before a wait-mode drain ends
                self.reject_new_requests = mode != "keep"
            await self.scheduler.pause(mode)
        await asyncio.sleep(_PAUSE_FLUSH_SECONDS)
        self.after(fired)
        return {"status": "paused"}

    async def resume(self) -> dict[str, object]:
        fired = await self.enter("resume")
        if (why := self.checkpoint.refusal("resume scheduling")) is not None:
            raise errors.plain_error(500, f"Failed to resume generation: Call to resume_scheduler method failed: {why}")
        if fired.kind != "lie-asleep":
            if self.memory_asleep:
                self.violate("resume_while_asleep", f"/resume while {sorted(self.memory_asleep)} asleep")
            self.scheduling_asleep = False
            if not self.executor_tags:
                self.sleep_level = None
            self._resume_scheduler()
        self.after(fired)
        return {"status": "resumed"}

    def _resume_scheduler(self) -> None:
        """EngineCoreProc.resume_scheduler: un-pause, (0.33) take back a user pause's refusal of new requests, and
        (0.34) end a checkpoint restore."""
        self.reject_new_requests = False
        self.scheduler.resume()
        if self.checkpoint.state is CheckpointState.RESTORING:
            self.checkpoint.state = CheckpointState.RUNNING

    def abort_requests(self, ids: list[str] | None) -> dict[str, object]:
        self.counters["abort_requests"] += 1
        self.check_alive()
        return {"status": "aborted", "aborted": self.scheduler.abort(set(ids) if ids else None)}

    async def fetch_weights(self, target_version: int) -> dict[str, object]:
        """SkyRL's /fetch_weights: the checkpoint delta downloaded and applied to the workers' files on disk
        (weight_sync/delta/): no GPU memory, so it runs awake, paused or asleep alike."""
        fired = await self.enter("fetch_weights")
        if not self.weight_transfer_initialized:
            raise errors.worker_failed("DeltaWeightTransferEngine has not been initialized")
        self.fetched_versions.add(target_version)
        self.after(fired)
        return {"status": "ok", "target_version": target_version, "stats": {"fetch_s": 0.0}}

    def reset_prefix_cache(self, reset_running: bool, reset_external: bool = False) -> dict[str, object]:
        """Scheduler.reset_prefix_cache: the GPU prefix cache (failing while a request holds blocks), and with
        `reset_external` the KV connector's tier, tried even when the first failed."""
        self.counters["reset_prefix_cache"] += 1
        self.check_alive()
        success = reset_running or self.scheduler.running == 0
        if success:
            self.prefix_cache.reset()
        if reset_external and self.offload_tier is not None:
            self.offload_tier.reset()
        return {"success": success}

    # --- weights
    async def collective_rpc(self, method: str, kwargs: dict[str, object] | None = None) -> dict[str, object] | None:
        fired = await self.enter("collective_rpc")
        if method in SKYRL_WORKER_RPCS and "skyrl" in self.settings.trainer_servers:
            await self._skyrl_rpc(method, kwargs or {}, fired)
            return None
        if method == "reset_weights":  # what /weight_checker's reset runs: zero_weights(model)
            self.weights_zeroed = True
            self.weights_valid = False
            self.after(fired)
            return None
        if method != "reload_weights":
            raise errors.worker_failed(f"'Worker' object has no attribute '{method}'")
        if fired.kind != "lie-asleep":
            if "weights" in self.memory_asleep:
                self.violate("reload_weights_while_asleep", "reload_weights while weights asleep")
            else:
                self.weights_valid = True
                self.garbage = False
                self.q_scale_lost = False  # the checkpoint's scales come back with it
                self.weight_writes = 0  # reloaded from the model's files on disk: the checkpoint again
                self.weights_committed_at = time.time()
                self.weights_zeroed = self.weights_partial = False
                # lie-weights: the checkpoint's file changed on disk since the start
                self.weights_altered = fired.kind == "lie-weights"
        self.after(fired)
        return None

    async def _skyrl_rpc(self, method: str, kwargs: dict[str, object], fired: Fired) -> None:
        """SkyRL's worker extension: 0.3.0's weight pushes write the weights in place; 0.4.0's
        NewInferenceWorkerWrap sleeps and wakes the allocator's pools, and arms LoRA rounds."""
        if method == "skyrl_sleep_for_weight_sync":
            await self._worker_sleep(bool(kwargs.get("offload_kv", True)), fired)
        elif method == "skyrl_wake_for_weight_sync":
            raw = kwargs.get("tags")
            await self._worker_wake({"weights", "kv_cache"} if raw is None else set(cast(list[str], raw)), fired)
        elif method == "skyrl_set_lora_receive_target":
            target = kwargs.get("receive_target")
            if not self.weight_transfer_initialized:
                raise errors.worker_failed("Weight transfer not configured: set weight_transfer_config on the engine.")
            if not isinstance(target, dict) or not target.get("lora_name"):
                raise errors.worker_failed("receive_target needs a lora_name")
            self.lora_round_target = str(target["lora_name"])
        elif method == "skyrl_discard_in_memory_lora":
            self.staged_adapters.discard(str(kwargs.get("lora_name")))
        elif method == "fetch_weights":
            await self.fetch_weights(int(cast(int, kwargs.get("target_version"))))
        elif "weights" in self.memory_asleep:
            self.violate(f"{method}_while_weights_asleep", f"{method} while the weights are asleep")
        elif method == "skyrl_finish_weight_update" and fired.kind != "lie-asleep":
            self.weights_valid = True
            self.garbage = False
            self.weight_writes += 1
        self.after(fired)

    async def _worker_sleep(self, offload_kv: bool, fired: Fired) -> None:
        """`skyrl_sleep_for_weight_sync`: the allocator's pools freed directly, the executor and the scheduler
        untouched (so vLLM's flags do not change); the weights are discarded, the KV cache offloaded or not."""
        if not self.is_paused:
            self.violate("worker_sleep_while_scheduling", "skyrl_sleep_for_weight_sync under a running scheduler")
        if fired.kind == "lie-asleep":
            return
        pools = {"weights", "kv_cache"} - self.executor_tags - self.worker_asleep
        self.worker_asleep |= pools
        self.weights_valid = False
        self.q_scale_lost = self.settings.fp8_kv_cache
        if self.settings.sleep_mode and fired.kind != "lie-memory":
            await asyncio.sleep(self.settings.sleep_seconds)
            await self._move(lambda: self.memory.release(pools, offload={"kv_cache"} if offload_kv else set()))

    async def _worker_wake(self, tags: set[str], fired: Fired) -> None:
        """`skyrl_wake_for_weight_sync`: maps the pools back; the scheduler stays as it was."""
        if fired.kind == "lie-asleep":
            return
        woken = tags & self.worker_asleep
        self.worker_asleep -= woken
        if woken and fired.kind != "lie-memory":
            await asyncio.sleep(self.settings.wake_seconds)
            await self._move(lambda: self.memory.restore(woken))

    # --- LoRA adapters (vLLM's OpenAIServingModels.load_lora_adapter / unload_lora_adapter)
    async def load_lora_adapter(self, name: str, path: str, *, in_place: bool) -> str:
        fired = await self.enter("load_lora_adapter")
        if name == self.settings.model:
            raise errors.bad_request(f"The lora adapter '{name}' conflicts with a served base model.")
        if not in_place and name in self.lora_adapters:
            raise errors.bad_request(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True."
            )
        if path.startswith(IN_MEMORY_LORA_PREFIX):
            if path.removeprefix(IN_MEMORY_LORA_PREFIX) not in self.staged_adapters:
                message = f"Loading lora {name} failed: no adapter tensors were staged for it"
                raise errors.EngineHTTPError(404, errors.openai_error(message, "NotFoundError", 404))
        elif not (Path(path) / "adapter_config.json").is_file():
            message = f"Loading lora {name} failed: No adapter found for {path}"
            raise errors.EngineHTTPError(404, errors.openai_error(message, "NotFoundError", 404))
        if "weights" in self.memory_asleep:
            self.violate("lora_load_while_weights_asleep", f"LoRA {name} loaded while the weights are asleep")
        self.lora_adapters[name] = path
        self.lora_lost.discard(name)
        self.after(fired)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: str) -> str:
        self.counters["unload_lora_adapter"] += 1
        self.check_alive()
        if name not in self.lora_adapters:
            raise errors.EngineHTTPError(
                404, errors.openai_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            )
        del self.lora_adapters[name]
        self.lora_lost.discard(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    # --- elastic EP (AsyncLLM.scale_elastic_ep, external load-balancer mode)
    async def scale_elastic_ep(self, new_size: int) -> dict[str, object]:
        """Scale the data-parallel size to `new_size`. The middleware gates every request while the commit runs; a
        rank at or past the new size is retired (0.33); a failed commit leaves the gate up, its phase "failed"."""
        fired = await self.enter("scale_elastic_ep", self.settings.scale_seconds)
        old = self.dp_size
        message: dict[str, object] = {"message": f"Scaled to {new_size} data parallel engines"}
        if new_size == old or fired.kind == "lie-asleep":
            self.after(fired)
            return message
        rank = self.settings.data_parallel_rank
        will_retire = self.profile.retires_ranks and (fired.kind == "retire" or (new_size < old and rank >= new_size))
        self.elastic_epoch = (self.elastic_epoch or 0) + 1
        self.elastic_requested = new_size
        self.elastic_phase = "committing"
        self.elastic_error = None
        self.elastic_scaling = True
        self.elastic_retired = will_retire
        await asyncio.sleep(self.settings.scale_seconds)
        if fired.kind == "scale-fails":
            self.elastic_retired = False
            self.elastic_phase = "failed"
            self.elastic_error = "Elastic EP commit failed: rank 1 did not reach the commit barrier"
            # vLLM's handler logs the cause and answers a bare HTTPException; the scaling gate stays up.
            raise errors.EngineHTTPError(500, errors.openai_error("Scale failed", "Internal Server Error", 500))
        self.dp_size = new_size
        self.elastic_phase = "completed"
        self.elastic_scaling = False
        self.after(fired)
        return message

    def init_weight_transfer_engine(self) -> dict[str, object]:
        self.counters["init_weight_transfer_engine"] += 1
        self.check_alive()
        self.weight_transfer_initialized = True
        return {"message": "Weight transfer initialized"}

    async def start_weight_update(self, *, draft: bool = False) -> dict[str, object]:
        """vLLM 0.32 `Worker._start_weight_update`: one session at a time, on the model or on its drafter."""
        fired = await self.enter("start_weight_update")
        if draft and not self.settings.draft_model:
            raise errors.worker_failed("Draft model weight update requested, but no draft model is configured.")
        if self.weight_update_active:
            raise errors.worker_failed(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        if fired.kind != "lie-asleep":
            self.weight_update_active = True
            self.weight_update_draft = draft
        self.after(fired)
        return {"message": "Draft weight update started" if draft else "Weight update started"}

    async def update_weights(self, update_info: dict[str, object] | None = None) -> dict[str, object]:
        fired = await self.enter("update_weights")
        if not self.weight_update_active:
            raise errors.worker_failed("start_weight_update must be called before update_weights.")
        if "weights" in self.memory_asleep:
            self.violate("update_weights_while_asleep", "/update_weights while weights asleep")
        version = (update_info or {}).get("target_version")
        if version is not None and int(cast(int, version)) not in self.fetched_versions:
            # SkyRL's DeltaWeightTransferEngine: LocalCheckpointStore.validate_ready before the reload.
            self.weight_update_active = False
            raise errors.worker_failed(f"delta checkpoint version {version} was not fetched (/fetch_weights first)")
        if fired.kind == "partial":
            # Worker.update_weights ends the session on any failure of the transfer engine (v1/worker/gpu_worker.py),
            # here ipc_engine.py's handle lookup after some tensors were already loaded.
            self.weight_update_active = self.weight_update_draft = False
            self.weights_partial = True
            uuid = self.settings.gpu_uuids[0]
            raise errors.worker_failed(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: ['GPU-trainer-0']")
        if self.weight_update_draft:
            self.draft_weight_writes += 1
        elif self.lora_round_target is None:
            self.weight_writes += 1
        self.after(fired)
        return {"message": "Weights updated"}

    async def finish_weight_update(self, version: str | None) -> dict[str, object]:
        fired = await self.enter("finish_weight_update")
        if not self.weight_update_active:
            raise errors.worker_failed("finish_weight_update called without a matching start_weight_update.")
        if fired.kind != "lie-asleep":
            self.weight_update_active = False
            if self.weight_update_draft:
                self.weight_update_draft = False  # the drafter's weights: the model's stay as they are
            elif self.lora_round_target is not None:
                self.staged_adapters.add(self.lora_round_target)  # SkyRL's receive engine disarms at finish
                self.lora_round_target = None
            else:
                self.weights_valid = True
                self.garbage = False
                self.weights_committed_at = time.time()
                self.weights_zeroed = self.weights_altered = self.weights_partial = False
            if version is not None:
                self.weight_version = version
        self.after(fired)
        return {"message": "Weight update finished"}

    def update_weight_version(self, version: str) -> dict[str, object]:
        self.counters["update_weight_version"] += 1
        self.check_alive()
        self.weight_version = version
        return {"success": True, "new_version": version}
