"""In front of a real vLLM-for-CPU (issue 21): throughput direct vs through the proxy, `max_tokens=1`.

The vLLM venv and tiny model come from scripts/vllm/setup-vllm.sh (cached in ~/.cache/vllm-lifeguard; it
builds them on first use, ~3 min), the server from scripts/vllm/vllm_server.py, started once. wrk sends
the same one-token completion direct and through vllm-lifeguard (and, with --baseline-src, the other checkout's),
interleaved in short runs whose order is reversed every other repetition, at each connection count. The
proxy's CPU per request is taken over the whole wrk run, so its idle loops at that rate are included; the
vLLM API server's own CPU per request is read the same way, for scale. Opt-in (`--only vllm` or `--vllm`):
vLLM takes about a minute to start here.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
from typing import Any

from benchmarks.fixed import wrk
from benchmarks.procs import cpu_seconds, log, median_dict, run_ratios
from benchmarks.rig import HERE, Rig
from scripts.vllm import vllm_server  # stdlib only; the tests' launcher of a real vLLM

ROOT = HERE.parent


def vllm_env() -> dict[str, str]:
    """The LIFEGUARD_VLLM_* variables setup-vllm.sh prints (`export K=V` lines)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm" / "setup-vllm.sh")], check=True, capture_output=True, text=True
    ).stdout
    env = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export ") :].split("=", 1)
            env[key] = value.strip("'\"")
    return env


async def bench_vllm(rig: Rig, conns_list: tuple[int, ...], seconds: float, reps: int) -> dict[str, Any]:
    env = vllm_env()
    os.environ.update(env)
    server = vllm_server.VllmServer(log_path=rig.workdir / "vllm.log", extra_args=vllm_server.SUITE_ARGS)
    log(f"real vLLM: starting {env.get('LIFEGUARD_VLLM_MODEL')} on {server.url}")
    server.spawn()
    try:
        await asyncio.to_thread(server.wait_healthy, 300.0)
        log(f"real vLLM healthy after {server.starts[-1]:.0f} s")
        await rig.start_lifeguards(server.url)
        ports = {"direct": server.port, "lifeguard": rig.lg_port}
        pids: dict[str, int | None] = {"direct": None, "lifeguard": rig.lg_pid}
        if rig.lg_base is not None:
            ports["lifeguard-base"], pids["lifeguard-base"] = rig.lg_base_port, rig.lg_base_pid
        for port in ports.values():  # warm: vLLM's first requests compile and allocate
            await wrk(port, 4, 2, None, max_tokens=1)
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for conns in conns_list:
            for rep in range(reps):
                # vLLM-for-CPU's own rate drifts by 2-4x over seconds on two shared cores (2026-12-06): short runs,
                # and the paths' order reversed every other repetition, so that each path meets the same drift.
                order = list(ports.items())
                if rep % 2:
                    order.reverse()
                for target, port in order:
                    api0 = cpu_seconds(server.pid) if server.pid else 0.0
                    result = await wrk(port, conns, seconds, pids[target], max_tokens=1)
                    api = cpu_seconds(server.pid) - api0 if server.pid else math.nan
                    result["vllm_api_cpu_us_per_req"] = api / max(result["requests"], 1) * 1e6
                    runs.setdefault((target, conns), []).append(result)
                    log(
                        f"vllm c={conns} rep={rep + 1} {target:13s} {result['rps']:7.0f} req/s "
                        f"p50 {result['p50_us'] / 1000:.2f} ms p99 {result['p99_us'] / 1000:.2f} ms "
                        f"proxy cpu {result['cpu_us_per_req']:.0f} us/req, vLLM API server "
                        f"{result['vllm_api_cpu_us_per_req']:.0f} us/req"
                    )
        await rig.stop_lifeguard()
    finally:
        server.stop()
    figures: dict[str, Any] = {f"{t}@{c}": median_dict(v) for (t, c), v in runs.items()}
    for conns in conns_list:
        # req/s through the proxy ÷ direct per repetition: the median and the spread, so that one lucky or
        # unlucky run is not read as the figure.
        by_path = {path: runs.get((path, conns), []) for path in ("lifeguard", "direct")}
        ratios = run_ratios(by_path, "lifeguard", "direct", "rps")
        figures[f"spread@{conns}"] = (
            {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1], "runs": len(ratios)}
            if ratios
            else {}
        )
    return figures
