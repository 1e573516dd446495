"""The performance table (`make bench`): direct to a trivial upstream, through nginx, Envoy and vllm-router
(the peers), through vllm-lifeguard.

Everything runs on loopback, started and stopped here, under one temp directory:
* nginx as the trivial upstream (fixed completion body, vLLM's flag routes), one worker;
* `upstream.py`, a raw-asyncio fake vLLM for what nginx cannot do: paced SSE streams with a send
  timestamp in every event, and `/sleep` / `/wake_up` that flip its flags;
* nginx as a reverse proxy in front of both (one worker: one proxy process against one proxy process),
  and beside it the other peers when `--peers-bin` has them: Envoy (`--concurrency 1`) and vllm-router;
* vllm-lifeguard (`python -m proxy serve`, from this checkout or `--proxy-src`), one process guarding one
  engine; for the non-streaming load also one guarding two engines (routed by model); and with
  `--baseline-src DIR` another checkout's proxy beside it (before/after in one run);
* with `--vllm` (or `--only vllm`): a real vLLM-for-CPU, direct vs through the proxy (`realvllm.py`).
Load comes from wrk (non-streaming) and from asyncio clients in this process (SSE, held requests).

One module per concern: `procs.py` (processes, /proc, plain HTTP), `rig.py` (the paths and what runs
behind them), `fixed.py`, `outside.py`, `sse.py`, `release.py`, `hold.py`, `lifecycle.py`, `swap.py`,
`realvllm.py` (the loads), `targets.py` (the speed targets, one table), `report.py` (the printed tables),
`verdicts.py` (issue 39's targets, MET or MISSED, printed under the table),
`charts.py` (the PNGs, from `--json`); this file only runs them.

Figures are medians over `--reps` interleaved repetitions. CPU time per request is read from
/proc/PID/stat around each run, so it holds even when other work shares the cores; throughput and
latency do not, so the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.fixed import bench_fixed
from benchmarks.hold import bench_hold
from benchmarks.lifecycle import bench_lifecycle
from benchmarks.mixed import bench_mixed
from benchmarks.outside import bench_outside
from benchmarks.procs import log
from benchmarks.realvllm import bench_vllm
from benchmarks.release import bench_release
from benchmarks.report import build_table, machine
from benchmarks.rig import Rig
from benchmarks.sse import bench_sse
from benchmarks.swap import bench_swap
from benchmarks.verdicts import issue39_lines

ROOT = Path(__file__).resolve().parents[1]
RIG_LOADS = {
    "fixed",
    "outside",
    "sse",
    "release",
    "lifecycle",
    "hold",
}  # the loads that run against start_fixed()'s processes


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lifeguard-bench."))
    try:
        yield path
    finally:
        if keep:
            log(f"logs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    res: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
    log(f"machine: {res['machine']}; vllm-lifeguard from {args.proxy_src}, baseline {args.baseline_src or 'none'}")
    with workdir(args.keep) as wd:
        baseline = Path(args.baseline_src).resolve() if args.baseline_src else None
        rig = Rig(wd, Path(args.proxy_src).resolve(), baseline_src=baseline)
        rig.peers_bin = Path(args.peers_bin) if args.peers_bin else None
        rig.upstream_max_connections = args.upstream_max_connections
        try:
            if args.only & RIG_LOADS:  # the swap and the real vLLM start upstreams of their own
                await rig.start_fixed()
            if "fixed" in args.only:
                res["fixed"] = await bench_fixed(rig, tuple(args.conns), args.seconds, args.reps)
            if "outside" in args.only:
                res["outside"] = await bench_outside(rig, args.outside_seconds, args.outside_reps)
            if "sse" in args.only:
                res["sse"] = await bench_sse(rig, tuple(args.streams), args.sse_rate, args.sse_seconds, args.reps)
            if "release" in args.only:
                res["release"] = await bench_release(rig, args.release_streams, args.release_reps)
            if "lifecycle" in args.only:
                res["lifecycle"] = await bench_lifecycle(rig, args.cycles, args.op_ms)
            if "swap" in args.only:
                res["swap"] = await bench_swap(rig, args.cycles, args.op_ms)
            if "mixed" in args.only:
                res["mixed"] = await bench_mixed(
                    rig, args.mixed_seconds, args.mixed_clients, args.mixed_op_ms, args.mixed_service_ms
                )
            if "hold" in args.only:
                res["hold"] = await bench_hold(rig, args.held, args.seconds, args.hold_reps)
            if "vllm" in args.only:
                res["vllm"] = await bench_vllm(rig, tuple(args.vllm_conns), args.vllm_seconds, args.vllm_reps)
        except Exception:
            for proc in rig.procs:
                log(f"--- {proc.name} log tail:\n{proc.tail()}")
            raise
        finally:
            rig.stop_all()
    with open("/proc/loadavg") as f:
        res["load_after"] = f.read().split()[:3]
    res["seconds"] = time.monotonic() - started
    res["paths"] = rig.paths
    print()
    print(f"vllm-lifeguard performance — {res['machine']} (after: {' '.join(res['load_after'])})")
    print(f"run took {res['seconds']:.0f} s; medians of {args.reps} run(s)" + (" (quick)" if args.quick else ""))
    print()
    for line in build_table(res, args):
        print(line)
    print()
    for line in issue39_lines(res, args):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short repetition of everything, 2,000 held (< 2 min)")
    parser.add_argument("--proxy-src", default=str(ROOT), help="checkout whose `proxy` package is benchmarked")
    parser.add_argument(
        "--only",
        default="fixed,outside,sse,release,lifecycle,swap,mixed,hold",
        help="comma list: fixed,outside,sse,release,lifecycle,swap,mixed,hold,vllm",
    )
    parser.add_argument("--vllm", action="store_true", help="add the real-vLLM rows (`vllm` in --only)")
    parser.add_argument(
        "--baseline-src", default="", help="another checkout whose proxy runs beside this one (before/after)"
    )
    parser.add_argument("--peers-bin", default="", help="folder with the `envoy` and `vllm-router` executables")
    parser.add_argument("--vllm-conns", default="1,16,64")
    parser.add_argument("--vllm-seconds", type=float, default=2.0, help="length of one wrk run in front of vLLM")
    parser.add_argument("--vllm-reps", type=int, default=8, help="interleaved repetitions in front of vLLM")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one wrk run")
    parser.add_argument("--conns", default="1,64,256")
    parser.add_argument("--outside-seconds", type=float, default=5.0, help="issue 39's outside row: one wrk run")
    parser.add_argument("--outside-reps", type=int, default=2, help="issue 39's outside row: alternated repetitions")
    parser.add_argument("--streams", default="64,512,2048")
    parser.add_argument(
        "--sse-rate", type=float, default=20_000, help="events/s the SSE source offers in all, for the latency rows"
    )
    parser.add_argument("--sse-seconds", type=float, default=4.0)
    parser.add_argument("--release-streams", type=int, default=2048, help="the release burst's held streams")
    parser.add_argument("--release-reps", type=int, default=3, help="the release burst's alternated repetitions")
    parser.add_argument(
        "--upstream-max-connections",
        type=int,
        default=0,
        help="every lifeguard's upstream_max_connections (0: the proxy's default, no cap on open connections)",
    )
    parser.add_argument("--held", type=int, default=10_000)
    parser.add_argument("--hold-reps", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--op-ms", type=float, default=10.0, help="the fake engine's own sleep/wake time")
    parser.add_argument("--mixed-seconds", type=float, default=40.0, help="mixed traffic: each mode's run")
    parser.add_argument("--mixed-clients", type=int, default=8)
    parser.add_argument("--mixed-op-ms", type=float, default=500.0, help="mixed traffic: a sleep's or wake's cost")
    parser.add_argument("--mixed-service-ms", type=float, default=50.0, help="mixed traffic: one generation")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir with every process's log")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.hold_reps, args.seconds, args.sse_seconds, args.cycles = 1, 1, 2.0, 2.0, 8
        args.vllm_reps = min(args.vllm_reps, 2)
        args.mixed_seconds = min(args.mixed_seconds, 20.0)
        args.held = min(args.held, 2_000)
        args.outside_seconds, args.release_reps = 2.0, 1
    args.only = set(args.only.split(","))
    if args.vllm:
        args.only.add("vllm")
    args.vllm_conns = [int(c) for c in str(args.vllm_conns).split(",")]
    args.conns = [int(c) for c in str(args.conns).split(",")]
    args.streams = [int(s) for s in str(args.streams).split(",")]
    for tool in ("nginx", "wrk") if args.only & RIG_LOADS else ("wrk",) if "vllm" in args.only else ():
        if shutil.which(tool) is None:
            print(f"bench: {tool} not found (scripts/bench.sh installs it)", file=sys.stderr)
            return 2
    try:
        import uvloop  # the load clients here, not the proxy under test (a process of its own)
    except ImportError:
        return asyncio.run(run(args))
    return int(uvloop.run(run(args)))


if __name__ == "__main__":
    sys.exit(main())
