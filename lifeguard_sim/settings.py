"""The simulator's settings: one frozen object built once and handed to the app."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lifeguard_sim.memory import MemoryKind
from lifeguard_sim.versions import DEFAULT, profile


@dataclass(frozen=True)
class SimSettings:
    """Everything the simulator can be told. Times are seconds, sizes GiB."""

    model: str = "tiny"
    # The vLLM release to behave like (lifeguard_sim/versions.py): "0.32", "0.33" or "0.34".
    vllm_version: str = DEFAULT
    sleep_seconds: float = 0.05
    wake_seconds: float = 0.1
    token_seconds: float = 0.002
    faults: Sequence[str] = field(default_factory=tuple)
    gpu_file: Path | str | None = None
    # Share the GPU file (and the device's total) with other simulators, this one's use under this name.
    gpu_file_engine: str | None = None
    # The devices it occupies on the shared GPU file, by UUID (tensor parallel: several, an equal share on each).
    gpu_uuids: Sequence[str] = ("GPU-sim-0",)
    # A wake that runs out of the shared device's memory wedges every later wake (only a restart clears it).
    oom_wedges: bool = False
    # simulated: the books only; cuda: real allocations on cuda:0 that NVML sees (scripts/gpu-check.sh).
    memory: MemoryKind = MemoryKind.SIMULATED
    weights_gib: float = 16
    kv_gib: float = 40
    overhead_gib: float = 2
    total_gib: float = 80
    seed: int = 0
    crash_exits_process: bool = False
    # False mimics vLLM started without --enable-sleep-mode: /sleep flips the flags but frees nothing.
    sleep_mode: bool = True
    # vLLM's API server notices a dead engine core and exits on a 5 s watchdog tick.
    watchdog_seconds: float = 5.0
    max_model_len: int = 16384
    # Tokens per KV block: the prefix cache reuses whole blocks (vLLM's --block-size).
    block_size: int = 16
    dtype: str = "bfloat16"
    # vLLM 0.32 serves /inference/v1/generate only with --enable-scale-out; without it the route answers 403.
    enable_scale_out: bool = False
    # vLLM mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with --enable-lora and
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.
    enable_lora: bool = False
    # Routes and worker-extension RPCs that trainers add with their own vLLM server wrapper
    # (lifeguard_sim/trainer_servers.py): any of "skyrl", "areal".
    trainer_servers: Sequence[str] = field(default_factory=tuple)
    # vLLM started with a speculative-decoding drafter (--speculative-config, MTP): /start_draft_weight_update
    # opens a session on it; without one vLLM 0.32's worker refuses it.
    draft_model: bool = False
    # An FP8 KV cache on vLLM >= 0.26 (SkyRL 0.4.0, inference_servers/vllm_compat.py): discarded weights take the
    # attention layers' _q_scale with them, the KV cache's wake resets only _k_scale/_v_scale, and every later
    # completion has NaN logprobs, weights pushed or not; only a reload from the checkpoint or a restart clears it.
    fp8_kv_cache: bool = False
    # Elastic EP in external-LB mode: this API server's data-parallel rank and the deployment's size. A
    # /scale_elastic_ep below this rank retires it (vLLM 0.33); the scale's commit takes `scale_seconds`.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    scale_seconds: float = 0.1
    # vLLM started without VLLM_SERVER_DEV_MODE=1: the dev routes (sleep, pause, weights, caches, collective_rpc,
    # server_info) are not served; 0.34's checkpoint routes still are, with sleep mode.
    dev_mode: bool = True
    # vLLM 0.34's --checkpoint-prepare-on-startup: the engine comes up PREPARED, refusing every request until a
    # /checkpoint/restore, while /health answers 200.
    checkpoint_prepare_on_startup: bool = False
    # vLLM's --kv-transfer-config with an offloading connector: a CPU/SSD tier of KV blocks beside the GPU prefix
    # cache (lifeguard_sim/offload_tier.py).
    kv_connector: bool = False
    # vLLM 0.34's --enable-fault-tolerance (lifeguard_sim/fault_tolerance.py), and its
    # fault_tolerance_config.engine_recovery_timeout_sec: how long a faulted engine waits for an instruction.
    enable_fault_tolerance: bool = False
    ft_recovery_seconds: float = 120.0

    def problem(self) -> str | None:
        """Why these settings describe no vLLM that could start, or None."""
        release = profile(self.vllm_version)
        if self.checkpoint_prepare_on_startup and not release.checkpoint:
            return f"--checkpoint-prepare-on-startup is a vLLM 0.34 flag (this is {release.version})"
        if self.checkpoint_prepare_on_startup and not self.sleep_mode:
            return "--checkpoint-prepare-on-startup needs sleep mode: vLLM refuses to start without --enable-sleep-mode"
        if self.enable_fault_tolerance and not release.fault_tolerance:
            return f"--enable-fault-tolerance is modelled for vLLM 0.34 only (this is {release.version})"
        return None
