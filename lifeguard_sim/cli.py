"""``vllm-lifeguard sim``: run the simulator as its own process."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from aiohttp import web

from lifeguard_sim.app import create_sim_app
from lifeguard_sim.faults import KINDS, OPS, FaultSpecError, parse_fault
from lifeguard_sim.memory import MemoryKind, MemoryUnavailable
from lifeguard_sim.settings import SimSettings
from lifeguard_sim.versions import DEFAULT, PROFILES

_EPILOG = (
    "fault specs: OP:KIND[@N|@pP]  (once by default; @N = the next N calls; @pP = probability P per call,\n"
    "from a seeded RNG). Repeat --fault for several; change them at run time with POST /sim/faults.\n\n"
    f"OP is one of: {', '.join(OPS)}\n\nKIND is one of:\n"
    + "\n".join(f"  {kind:<11} {text}" for kind, text in KINDS.items())
    + "\n\nexamples:\n  --fault wake_up:error500@1 --fault sleep:lie-dead@p0.1 --fault generate:slow:0.5@3\n\n"
    "--vllm-version 0.32 behaves like vLLM 0.32.0 (as measured on vLLM-for-CPU); 0.33, the default, like 0.33.0;\n"
    "0.34 like 0.34.0 (the checkpoint lifecycle, reset_connector, fault tolerance, pinned host backups).\n\n"
    "sim-only routes: GET /sim/state (true engine state, memory, counters, violations),\n"
    "GET /sim/faults, POST /sim/faults (JSON list of specs; [] clears)."
)


def build_parser() -> argparse.ArgumentParser:
    defaults = SimSettings()
    parser = argparse.ArgumentParser(
        prog="vllm-lifeguard sim",
        description="A vLLM 0.32, 0.33 or 0.34 stand-in that is faithful on every sleep/wake/pause/weight-update "
        "path and can fail the ways vLLM fails.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add("--model", default=defaults.model, help="served model name (default: %(default)s)")
    add(
        "--vllm-version",
        default=DEFAULT,
        choices=list(PROFILES),
        help="the vLLM release to behave like: 0.33 refuses new requests during /pause?mode=abort|wait, exempts "
        "/health from the elastic-EP gate, retires ranks, serves /v1/decisions and weight-version spans; 0.34 adds "
        "the /checkpoint routes, reset_connector, fault tolerance and pinned host backups (default: %(default)s)",
    )
    add(
        "--sleep-seconds",
        type=float,
        default=defaults.sleep_seconds,
        help="time a level>=1 sleep takes (default: %(default)s)",
    )
    add(
        "--wake-seconds",
        type=float,
        default=defaults.wake_seconds,
        help="time a wake of sleeping tags takes (default: %(default)s)",
    )
    add(
        "--token-seconds",
        type=float,
        default=defaults.token_seconds,
        help="time per generated token (default: %(default)s)",
    )
    add(
        "--fault", action="append", default=[], metavar="OP:KIND[@N|@pP]", help="inject a fault (repeatable; see below)"
    )
    add(
        "--gpu-file",
        default=None,
        metavar="PATH",
        help="write simulated GPU memory as JSON here, atomically, at start and on every change",
    )
    add(
        "--gpu-file-engine",
        default=None,
        metavar="NAME",
        help="share --gpu-file and the device total with other simulators, this one's use under NAME; "
        "a wake that does not fit fails with CUDA out of memory",
    )
    add(
        "--gpu-uuid",
        action="append",
        default=[],
        metavar="UUID",
        help="with --gpu-file-engine: a device it occupies, by UUID (repeatable: an equal share on each; "
        "default GPU-sim-0); the file lists every device any engine names, in UUID order",
    )
    add(
        "--memory",
        type=MemoryKind,
        default=defaults.memory,
        choices=list(MemoryKind),
        help="simulated: keep the books; cuda: allocate the weights and KV pool on cuda:0 with torch, so NVML "
        "sees them move (scripts/gpu-check.sh) (default: %(default)s)",
    )
    add("--weights-gib", type=float, default=defaults.weights_gib, help="weights size (default: %(default)s)")
    add("--kv-gib", type=float, default=defaults.kv_gib, help="KV cache pool size (default: %(default)s)")
    add(
        "--overhead-gib",
        type=float,
        default=defaults.overhead_gib,
        help="memory that never sleeps: CUDA context, activations (default: %(default)s)",
    )
    add("--total-gib", type=float, default=defaults.total_gib, help="device memory (default: %(default)s)")
    add("--seed", type=int, default=defaults.seed, help="seed for generated text and @pP faults")
    add("--max-model-len", type=int, default=defaults.max_model_len, help="context length (default: %(default)s)")
    add("--block-size", type=int, default=defaults.block_size, help="tokens per KV block (default: %(default)s)")
    add(
        "--oom-wedges",
        action="store_true",
        help="with --gpu-file-engine: a wake that runs out of memory wedges every later wake until a restart",
    )
    add(
        "--no-sleep-mode",
        action="store_true",
        help="act like vLLM without --enable-sleep-mode: /sleep answers 200 and flips the flags but frees no memory",
    )
    add(
        "--watchdog-seconds",
        type=float,
        default=defaults.watchdog_seconds,
        help="after lie-dead, the process exits this much later (default: %(default)s)",
    )
    add("--enable-scale-out", action="store_true", help="serve /inference/v1/generate, like vLLM's flag")
    add(
        "--enable-lora",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    add(
        "--trainer-server",
        action="append",
        default=[],
        choices=("skyrl", "areal"),
        help="also serve that trainer's own server-wrapper routes and worker-extension RPCs (repeatable)",
    )
    add(
        "--draft-model",
        action="store_true",
        help="a speculative-decoding drafter is loaded (vLLM: --speculative-config): /start_draft_weight_update "
        "opens a weight update session on it",
    )
    add(
        "--fp8-kv-cache",
        action="store_true",
        help="an FP8 KV cache on vLLM >= 0.26: after weights are discarded (a level-2 sleep, SkyRL's worker sleep), "
        "_q_scale stays 0.0 and every completion has NaN logprobs until a reload_weights or a restart",
    )
    add(
        "--data-parallel-size",
        type=int,
        default=defaults.data_parallel_size,
        help="elastic EP: the deployment's data-parallel size (default: %(default)s)",
    )
    add(
        "--data-parallel-rank",
        type=int,
        default=defaults.data_parallel_rank,
        help="elastic EP: this API server's rank; a /scale_elastic_ep to a size at or below it retires it on 0.33 "
        "(default: %(default)s)",
    )
    add(
        "--scale-seconds",
        type=float,
        default=defaults.scale_seconds,
        help="how long a /scale_elastic_ep commit takes, serving gated meanwhile (default: %(default)s)",
    )
    add(
        "--no-dev-mode",
        action="store_true",
        help="act like vLLM started without VLLM_SERVER_DEV_MODE=1: no sleep, pause, weight, cache, collective_rpc "
        "or server_info routes (0.34's /checkpoint routes stay, with sleep mode)",
    )
    add(
        "--checkpoint-prepare-on-startup",
        action="store_true",
        help="0.34: come up PREPARED (KV cache released, every request refused engine_paused, /health 200) until "
        "POST /checkpoint/restore",
    )
    add(
        "--kv-connector",
        action="store_true",
        help="a KV connector with a CPU offload tier (vLLM's --kv-transfer-config): blocks kept there survive a GPU "
        "prefix-cache reset and serve later prompts, computed by whatever weights were loaded then",
    )
    add(
        "--enable-fault-tolerance",
        action="store_true",
        help="0.34: serve /v1/fault_tolerance/{apply,status}; a faulted engine refuses requests 503 EngineFaultedError "
        "until an apply heals it",
    )
    add(
        "--ft-recovery-seconds",
        type=float,
        default=defaults.ft_recovery_seconds,
        help="with --enable-fault-tolerance: how long a faulted engine waits for an instruction before it dies "
        "(vLLM's engine_recovery_timeout_sec) (default: %(default)s)",
    )
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def settings_from(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        model=args.model,
        vllm_version=args.vllm_version,
        data_parallel_size=args.data_parallel_size,
        data_parallel_rank=args.data_parallel_rank,
        scale_seconds=args.scale_seconds,
        sleep_seconds=args.sleep_seconds,
        wake_seconds=args.wake_seconds,
        token_seconds=args.token_seconds,
        faults=tuple(args.fault),
        gpu_file=args.gpu_file,
        gpu_file_engine=args.gpu_file_engine,
        gpu_uuids=tuple(args.gpu_uuid) or SimSettings.gpu_uuids,
        memory=args.memory,
        weights_gib=args.weights_gib,
        kv_gib=args.kv_gib,
        overhead_gib=args.overhead_gib,
        total_gib=args.total_gib,
        seed=args.seed,
        crash_exits_process=True,
        sleep_mode=not args.no_sleep_mode,
        oom_wedges=args.oom_wedges,
        watchdog_seconds=args.watchdog_seconds,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_scale_out=args.enable_scale_out,
        enable_lora=args.enable_lora,
        trainer_servers=tuple(args.trainer_server),
        draft_model=args.draft_model,
        fp8_kv_cache=args.fp8_kv_cache,
        dev_mode=not args.no_dev_mode,
        checkpoint_prepare_on_startup=args.checkpoint_prepare_on_startup,
        kv_connector=args.kv_connector,
        enable_fault_tolerance=args.enable_fault_tolerance,
        ft_recovery_seconds=args.ft_recovery_seconds,
    )


def main(argv: list[str]) -> int:
    return serve(parse(argv))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for spec in args.fault:
        try:
            parse_fault(spec)
        except FaultSpecError as exc:
            parser.error(str(exc))
    if (problem := settings_from(args).problem()) is not None:
        parser.error(problem)
    return args


def serve(args: argparse.Namespace, sockets: list[socket.socket] | None = None) -> int:
    """Run until a signal; on `sockets` (bound) when given, else on `--host` and `--port`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_sim_app(settings_from(args))
    except MemoryUnavailable as exc:
        build_parser().error(str(exc))
    web.run_app(
        app,
        host=None if sockets else args.host,
        port=None if sockets else args.port,
        sock=sockets,
        handler_cancellation=True,
        shutdown_timeout=5.0,
        print=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
