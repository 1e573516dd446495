"""Lifecycle: sleep/wake cycles direct to the fake vLLM, then through the proxy."""

from __future__ import annotations

import statistics
import time

from benchmarks.procs import http, log
from benchmarks.rig import Rig


async def bench_lifecycle(rig: Rig, cycles: int, op_ms: float) -> dict[str, float]:
    await http(rig.sse_port, "POST", f"/bench/config?op_ms={op_ms:g}")
    times: dict[str, list[float]] = {}
    for target, port in (("direct", rig.sse_port), ("lifeguard", 0)):
        if target == "lifeguard":
            await rig.start_lifeguard(rig.sse_port)
            port = rig.lg_port
        for _ in range(cycles):
            for op, path in (("sleep", "/sleep?level=1"), ("wake", "/wake_up")):
                t0 = time.perf_counter()
                status, body = await http(port, "POST", path)
                elapsed = time.perf_counter() - t0
                if status != 200:
                    raise RuntimeError(f"{target} {path} answered {status}: {body[:300]!r}")
                times.setdefault(f"{target}_{op}_ms", []).append(elapsed * 1000)
    await rig.stop_lifeguard()
    result = {key: statistics.median(v) for key, v in times.items()}
    result["op_ms"] = op_ms
    log(f"lifecycle ({cycles} cycles, engine op {op_ms:g} ms): " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()))
    return result
