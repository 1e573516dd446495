"""The engine's operations, with no HTTP: sleep, wake, pause, resume, weight updates, LoRA, elastic EP and the
process checkpoint, on the state `lifeguard_sim/engine_core.py` keeps.

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
retire this rank, and the engine-death message is sanitised; 0.34 adds the process checkpoint (sleep, wake and resume
refused while it is not running), ``reset_connector`` and pinned host backups.

Breaches of engine safety go to ``violations``: the proxy's end-to-end tests assert it stays empty.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import cast

from lifeguard_sim import errors
from lifeguard_sim.checkpoint import NEEDS_AWAKE, NEEDS_SLEEP_MODE, CheckpointState
from lifeguard_sim.engine_core import AWAKE_METRIC, EngineCore
from lifeguard_sim.faults import Fired
from lifeguard_sim.memory import MEMORY_TAGS

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
# vLLM's /pause handler sleeps 20 ms after the engine acknowledges, to let outputs flush.
_PAUSE_FLUSH_SECONDS = 0.02


class Engine(EngineCore):
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
            self.sleep_metric = AWAKE_METRIC
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

    async def reset_prefix_cache(self, reset_running: bool, reset_external: bool = False) -> dict[str, object]:
        """Scheduler.reset_prefix_cache: the GPU prefix cache (failing while a request holds blocks), and with
        `reset_external` the KV connector's tier, tried even when the first failed."""
        await self.enter("reset_prefix_cache")
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
        uuid = self.settings.gpu_uuids[0]
        elsewhere = _ipc_handles_elsewhere(update_info, uuid)
        if fired.kind == "partial" or elsewhere is not None:
            # Worker.update_weights ends the session on any failure of the transfer engine (v1/worker/gpu_worker.py),
            # here ipc_engine.py's handle lookup after some tensors were already loaded.
            self.weight_update_active = self.weight_update_draft = False
            self.weights_partial = True
            available = elsewhere or ["GPU-trainer-0"]
            raise errors.worker_failed(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {available}")
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


def _ipc_handles_elsewhere(update_info: dict[str, object] | None, uuid: str) -> list[str] | None:
    """The GPUs an IPC chunk's handles name when one names none of this engine's (ipc_engine.py receive_weights: a
    per-parameter handle is looked up by the worker's physical GPU UUID); None for any other chunk."""
    handles = (update_info or {}).get("ipc_handles")
    for handle in handles if isinstance(handles, list) else ():
        if isinstance(handle, dict) and uuid not in handle:
            return [str(key) for key in handle]
    return None
