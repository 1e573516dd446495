"""Non-streaming load: wrk against each path, the proxy's CPU per request and RSS under load."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from typing import Any

from benchmarks.procs import cpu_seconds, log, median_dict, rss_bytes, tree_cpu_seconds
from benchmarks.rig import HERE, TWO_ENGINE_MODELS, Rig


async def wrk(
    port: int,
    conns: int,
    seconds: float,
    pid: int | None,
    max_tokens: int = 2,
    models: tuple[str, ...] = ("tiny",),
    tree: bool = False,
) -> dict[str, float]:
    """One wrk run (its requests alternating between `models`); adds the proxy's CPU seconds (with `tree`,
    its whole process tree's) and its RSS sampled half-way."""
    cpu_seconds_of = tree_cpu_seconds if tree else cpu_seconds
    argv = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(HERE / "wrk-post.lua")]
    argv.append(f"http://127.0.0.1:{port}/v1/completions")
    cpu0 = cpu_seconds_of(pid) if pid else 0.0
    env = {**os.environ, "WRK_MAX_TOKENS": str(max_tokens), "WRK_MODELS": ",".join(models)}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    await asyncio.sleep(seconds / 2)
    rss = rss_bytes(pid) if pid else 0
    out, err = await proc.communicate()
    cpu = cpu_seconds_of(pid) - cpu0 if pid else 0.0
    match = re.search(rb"WRKJSON (\{.*\})", out)
    if match is None:
        raise RuntimeError(f"wrk printed no result: {out.decode()} {err.decode()}")
    result: dict[str, float] = json.loads(match.group(1))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    result["cpu_us_per_req"] = cpu / max(result["requests"], 1) * 1e6 if pid else math.nan
    result["rss"] = rss
    if result["errors"] or result["non2xx"]:
        log(f"  wrk on :{port} c={conns}: {result['errors']} socket errors, {result['non2xx']} non-2xx")
    return result


async def bench_fixed(rig: Rig, conns_list: tuple[int, ...], seconds: float, reps: int) -> dict[str, Any]:
    """Every path gets the same requests, alternating between the two-engine proxy's two model names (a
    path of one engine, or a peer, ignores the name): the two-engine figure is measured on the same load."""
    await rig.start_lifeguards(f"http://127.0.0.1:{rig.up_port}", two_engines=True)
    for target in rig.paths:  # warm every path (connection pools, lazily imported code)
        await wrk(rig.port(target), 16, 1, None, models=TWO_ENGINE_MODELS)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for conns in conns_list:
        for rep in range(reps):
            for target in rig.paths:
                result = await wrk(rig.port(target), conns, seconds, rig.proxy_pid(target), models=TWO_ENGINE_MODELS)
                runs.setdefault((target, conns), []).append(result)
                log(
                    f"fixed c={conns} rep={rep + 1} {target:13s} {result['rps']:8.0f} req/s "
                    f"p50 {result['p50_us'] / 1000:.3f} ms p99 {result['p99_us'] / 1000:.3f} ms "
                    f"cpu {result['cpu_us_per_req']:.0f} us/req"
                )
    await rig.stop_lifeguard()
    return {f"{t}@{c}": median_dict(v) for (t, c), v in runs.items()}
