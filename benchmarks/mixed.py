"""Model swap under mixed traffic: two fake vLLMs that do not fit together behind one lifeguard with
`engines:`, each swap costing a realistic sleep and wake (`op_ms` each) and each request a generation
(`service_ms`); clients each ask for one of the two models at random, back to back, for `seconds`.

Run twice in one rig, side by side: with turns (`swap_quantum_s` at its default) and as naive alternation
(`swap_quantum_s: 0`: the awake model is drained and swapped out as soon as a request for the other waits:
one swap per change of model, what llama-swap does). For each: requests answered and refused, swaps,
requests per swap, the requests' p50/p99 latency (their wait for a swap included), swaps per minute.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sys
import time

from benchmarks.procs import free_port, http, log, wait_until
from benchmarks.rig import HERE, Rig

MODELS = {"policy": "policy-model", "judge": "judge-model"}
DEFAULT_QUANTUM_S = 10.0  # proxy/config/settings.py's swap_quantum_s


async def bench_mixed(
    rig: Rig, seconds: float, clients: int, op_ms: float, service_ms: float
) -> dict[str, dict[str, float]]:
    results = {}
    for mode, quantum in (("turns", DEFAULT_QUANTUM_S), ("alternation", 0.0)):
        results[mode] = await _one(rig, mode, quantum, seconds, clients, op_ms, service_ms)
    return results


async def _one(
    rig: Rig, mode: str, quantum: float, seconds: float, clients: int, op_ms: float, service_ms: float
) -> dict[str, float]:
    ports = {name: free_port() for name in MODELS}
    for name, port in ports.items():
        rig.start(f"fake-vllm-{mode}-{name}", [sys.executable, str(HERE / "upstream.py"), "--port", str(port)])
    for port in ports.values():
        await wait_until(functools.partial(_healthy, port), f"fake vLLM on port {port}")
        await http(port, "POST", f"/bench/config?op_ms={op_ms:g}&service_ms={service_ms:g}")
    engines = [
        {"name": name, "upstream": f"http://127.0.0.1:{port}", "gpus": [0], "models": [MODELS[name]]}
        for name, port in ports.items()
    ]
    # No GPU reading: admission then puts every other engine on the GPU to sleep before a wake (one fits).
    config = rig.workdir / f"engines-{mode}.yaml"
    config.write_text(json.dumps({"engines": engines, "gpu_probe": "none", "canary_enabled": False,
                                  "swap_quantum_s": quantum, "hold_timeout_s": 120}))  # fmt: skip
    await rig.start_lifeguard_engines(config)
    status, body = await http(rig.lg_port, "POST", "/engines/judge/sleep?level=1")
    if status != 200:
        raise RuntimeError(f"putting the judge to sleep answered {status}: {body[:300]!r}")
    latencies: list[float] = []
    statuses: list[int] = []
    rng = random.Random(17)
    stop = time.monotonic() + seconds

    async def client() -> None:
        own = random.Random(rng.random())
        while time.monotonic() < stop:
            name = own.choice(list(MODELS))
            t0 = time.perf_counter()
            status = await _completion(rig.lg_port, MODELS[name])
            latencies.append(time.perf_counter() - t0)
            statuses.append(status)

    swaps0 = await _swaps(rig.lg_port)
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - started
    swaps = await _swaps(rig.lg_port) - swaps0
    await rig.stop_lifeguard()
    for name in MODELS:
        rig.stop_named(f"fake-vllm-{mode}-{name}")
    latencies.sort()
    ok = sum(1 for s in statuses if s == 200)
    result = {
        "quantum_s": quantum,
        "seconds": elapsed,
        "requests": len(statuses),
        "ok": ok,
        "refused": len(statuses) - ok,
        "swaps": swaps,
        "requests_per_swap": ok / swaps if swaps else float(ok),
        "p50_s": latencies[len(latencies) // 2] if latencies else float("nan"),
        "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else float("nan"),
        "swaps_per_min": swaps / elapsed * 60,
        "rps": ok / elapsed,
    }
    log(
        f"mixed {mode:11s} quantum {quantum:g} s: {ok}/{len(statuses)} answered 200, {swaps} swaps, "
        f"{result['requests_per_swap']:.1f} requests/swap, p50 {result['p50_s']:.2f} s p99 {result['p99_s']:.2f} s"
    )
    return result


async def _completion(port: int, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    status, _ = await http(port, "POST", "/v1/completions", body, timeout=150)
    return status


async def _swaps(port: int) -> int:
    status, body = await http(port, "GET", "/lifeguard/metrics")
    total = 0
    for line in body.decode().splitlines():
        if line.startswith("lifeguard_swaps_total{") and 'outcome="ok"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def _healthy(port: int) -> bool:
    status, _ = await http(port, "GET", "/health")
    return status == 200
