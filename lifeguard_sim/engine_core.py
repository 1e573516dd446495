"""The engine's state and the frame every operation runs in, with no HTTP: the flags, the weights, the caches, the
faults, the counters, the violations; what a simulated process death, restart or shutdown does; and the checks a model
step makes. The operations themselves (sleep, pause, weights, checkpoint...) are `lifeguard_sim/engine.py`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import cast

from lifeguard_sim import errors
from lifeguard_sim.checkpoint import Checkpoint, CheckpointState
from lifeguard_sim.errors import EngineGone
from lifeguard_sim.fault_tolerance import FaultTolerance
from lifeguard_sim.faults import FaultBook, Fired
from lifeguard_sim.memory import DeviceMemory, make_memory, write_gpu_file
from lifeguard_sim.prefix_cache import PrefixCache
from lifeguard_sim.scheduler import PauseState, Scheduler, SimRequest, spans
from lifeguard_sim.settings import SimSettings
from lifeguard_sim.shared_gpu import SharedGpuFile
from lifeguard_sim.versions import profile

AWAKE_METRIC = (1, 0, 0)


class EngineCore:
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
        self.sleep_metric = AWAKE_METRIC
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

    def _release_for_checkpoint(self) -> None:
        self.reset_caches(reset_connector=True)
        self.executor_tags |= {"kv_cache"}
        if self.settings.sleep_mode:
            self.memory.release({"kv_cache"})
        self.checkpoint.state = CheckpointState.PREPARED
