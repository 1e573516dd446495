"""Issue 39's outside measurement as a row of its own, and the runs that say why it disagreed with the rig's row.

The outside measurement (2026-12-06): `wrk -t1 -c64` POST `/v1/completions` for 5 s, twice per variant, against
the nginx upstream (one worker, a fixed completion body), each proxy with one worker or thread, CPU = utime +
stime of the proxy's whole process tree ÷ requests. It gave lifeguard 2.7-2.9× nginx where fixed.py's row said
1.81×.

`bench_outside` (`outside` in run.py's --only) is that configuration: wrk's one fixed body (one model name), the
rig's nginx upstream, every peer and lifeguard, process-tree CPU (nginx: master and worker), the order of the
variants reversed every other repetition.

`python -m benchmarks.outside --vary client,upstream,cpu,logging,loop,contention` changes one variable at a
time between lifeguard and nginx, its two values alternated, and prints lifeguard ÷ nginx per repetition:
* client: wrk's one fixed body (outside) / a body per request alternating between two model names (fixed.py);
* upstream: the nginx upstream / the fake vLLM `upstream.py` (nginx relays it through its SSE server);
* cpu: the process tree / the one process fixed.py measures (nginx: its worker);
* logging: the rig's `--log-level warning` / `serve`'s default, info;
* loop: uvloop (the default) / asyncio's own (`LIFEGUARD_EVENT_LOOP=asyncio`);
* contention: the cores as they are / two more busy loops on them while each run lasts;
* cache: two more busy loops / two more loops copying 64 MiB over and over (what they evict, not their CPU);
* floor: lifeguard / `floor.py`, a bare relay on uvloop (the least Python any proxy on uvloop runs per request:
  what lifeguard costs above it is its own, what it costs above nginx is the language's and the loop's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.fixed import wrk
from benchmarks.procs import free_port, log, median_dict, run_ratios, wait_until
from benchmarks.rig import TWO_ENGINE_MODELS, Rig

CONNS = 64
HERE = Path(__file__).resolve().parent
#: a co-runner that streams through memory (evicting the caches it shares), where `while True: pass` barely touches them
MEMORY_HOG = "b = bytearray(64 << 20)\nwhile True: bytes(b)"


@dataclass(frozen=True)
class Variant:
    """One path under the outside load: where wrk sends it, whose CPU it counts, and how."""

    port: int
    pid: int
    models: tuple[str, ...] = ("tiny",)
    tree: bool = True
    hogs: int = 0  # busy loops running beside it while the run lasts
    hog: str = "while True: pass"  # what each runs (Python)


@contextlib.contextmanager
def busy_loops(count: int, code: str) -> Iterator[None]:
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


async def alternated(variants: dict[str, Variant], seconds: float, reps: int) -> dict[str, list[dict[str, float]]]:
    """Every variant once per repetition, the order reversed every other repetition."""
    runs: dict[str, list[dict[str, float]]] = {}
    for rep in range(reps):
        names = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in names:
            v = variants[name]
            with busy_loops(v.hogs, v.hog):
                r = await wrk(v.port, CONNS, seconds, v.pid, models=v.models, tree=v.tree)
            with open("/proc/loadavg") as f:
                r["load1"] = float(f.read().split()[0])
            runs.setdefault(name, []).append(r)
            log(
                f"outside rep={rep + 1} {name:28s} {r['rps']:8.0f} req/s cpu {r['cpu_us_per_req']:.1f} us/req "
                f"(load {r['load1']:.1f})"
            )
    return runs


def peer_variants(rig: Rig) -> dict[str, Variant]:
    """nginx, Envoy and vllm-router as the outside measured them (each a process tree of its own)."""
    pids = {"nginx": rig.nginx_master, "envoy": rig.envoy_pid, "vllm-router": rig.router_pid}
    return {path: Variant(rig.port(path), pids[path]) for path in pids if path in rig.paths}


async def bench_outside(rig: Rig, seconds: float, reps: int) -> dict[str, Any]:
    await rig.start_lifeguards(f"http://127.0.0.1:{rig.up_port}")
    assert rig.lg_pid is not None
    variants = {**peer_variants(rig), "lifeguard": Variant(rig.lg_port, rig.lg_pid)}
    for v in variants.values():  # warm every path, as fixed.py does
        await wrk(v.port, 16, 1, None)
    runs = await alternated(variants, seconds, reps)
    await rig.stop_lifeguard()
    result: dict[str, Any] = {path: median_dict(r) for path, r in runs.items()}
    result["cpu_vs_nginx"] = run_ratios(runs, "lifeguard", "nginx", "cpu_us_per_req")
    result["rps_vs_nginx"] = run_ratios(runs, "lifeguard", "nginx", "rps")
    result["runs"] = runs
    return result


# ------------------------------------------------------------------------------------- one variable at a time


async def vary(rig: Rig, name: str) -> tuple[str, str, dict[str, Variant]]:
    """The variable's two values (A, B) as variants of nginx and lifeguard: `nginx|A`, `lifeguard|A`, ..."""
    lg, lg_port = await rig.launch(["--upstream", f"http://127.0.0.1:{rig.up_port}"], "a")
    nginx = Variant(rig.nginx_port, rig.nginx_master)
    a = Variant(lg_port, lg.pid)
    if name == "client":
        values = ("one fixed body", "two models alternating")
        b_nginx, b = replace(nginx, models=TWO_ENGINE_MODELS), replace(a, models=TWO_ENGINE_MODELS)
    elif name == "upstream":
        values = ("nginx upstream", "fake vLLM upstream.py")
        lg_b, port_b = await rig.launch(["--upstream", f"http://127.0.0.1:{rig.sse_port}"], "b")
        b_nginx, b = replace(nginx, port=rig.nginx_sse_port), Variant(port_b, lg_b.pid)
    elif name == "cpu":
        values = ("process tree", "one process")
        b_nginx, b = replace(nginx, pid=rig.nginx_worker, tree=False), replace(a, tree=False)
    elif name == "logging":
        values = ("--log-level warning", "info (serve's default)")
        lg_b, port_b = await rig.launch(["--upstream", f"http://127.0.0.1:{rig.up_port}"], "b", ("--log-level", "info"))
        b_nginx, b = nginx, Variant(port_b, lg_b.pid)
    elif name == "loop":
        values = ("uvloop", "asyncio's loop")
        env = {"LIFEGUARD_EVENT_LOOP": "asyncio"}
        lg_b, port_b = await rig.launch(["--upstream", f"http://127.0.0.1:{rig.up_port}"], "b", env=env)
        b_nginx, b = nginx, Variant(port_b, lg_b.pid)
    elif name == "contention":
        values = ("the cores as they are", "+2 busy loops")
        b_nginx, b = replace(nginx, hogs=2), replace(a, hogs=2)
    elif name == "cache":
        values = ("+2 busy loops", "+2 loops copying 64 MiB")
        nginx, a = replace(nginx, hogs=2), replace(a, hogs=2)
        b_nginx, b = replace(nginx, hog=MEMORY_HOG), replace(a, hog=MEMORY_HOG)
    elif name == "floor":
        values = ("lifeguard", "floor.py: a bare relay on uvloop")
        port_b = free_port()
        argv = [sys.executable, str(HERE / "floor.py"), "--port", str(port_b), "--upstream-port", str(rig.up_port)]
        floor = rig.start("lifeguard-b", argv)  # named so that the round's end stops it with the others
        await wait_until(lambda: accepts(port_b), "floor.py to accept connections")
        b_nginx, b = nginx, Variant(port_b, floor.pid)
    else:
        raise SystemExit(f"outside.py: no variable {name!r}")
    variants = {"nginx|A": nginx, "lifeguard|A": a, "nginx|B": b_nginx, "lifeguard|B": b}
    for v in variants.values():
        await wrk(v.port, 16, 1, None)
    return values[0], values[1], variants


async def accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


def joined(values: list[float], spec: str) -> str:
    return " / ".join(format(v, spec) for v in values)


async def run_vary(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="lifeguard-outside."))
    rig = Rig(workdir, Path(args.proxy_src).resolve())
    lines = [
        "| variable | value | lifeguard CPU/request (runs) | nginx CPU/request (runs) | lifeguard ÷ nginx per run | "
        "req/s ÷ nginx per run | load average |",
        "|---|---|---|---|---|---|---|",
    ]
    try:
        await rig.start_fixed()
        for name in args.vary.split(","):
            value_a, value_b, variants = await vary(rig, name)
            runs = await alternated(variants, args.seconds, args.reps)
            for value, key in ((value_a, "A"), (value_b, "B")):
                lg, nginx = runs[f"lifeguard|{key}"], runs[f"nginx|{key}"]
                cpu = run_ratios({"l": lg, "n": nginx}, "l", "n", "cpu_us_per_req")
                rps = run_ratios({"l": lg, "n": nginx}, "l", "n", "rps")
                loads = [r["load1"] for r in lg + nginx]
                lg_cpu, nginx_cpu = (joined([r["cpu_us_per_req"] for r in x], ".0f") for x in (lg, nginx))
                lines.append(
                    f"| {name} | {value} | {lg_cpu} µs | {nginx_cpu} µs | {joined(cpu, '.2f')} (median "
                    f"{statistics.median(cpu):.2f}×) | {joined(rps, '.2f')} | {min(loads):.1f}–{max(loads):.1f} |"
                )
            for suffix in ("a", "b"):
                rig.stop_named(f"lifeguard-{suffix}")
    finally:
        rig.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vary", default="client,upstream,cpu,logging,loop,contention")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--proxy-src", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    try:
        import uvloop  # the load's own side, as in run.py
    except ImportError:
        return asyncio.run(run_vary(args))
    return int(uvloop.run(run_vary(args)))


if __name__ == "__main__":
    sys.exit(main())
