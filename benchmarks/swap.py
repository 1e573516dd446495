"""Model swap: two fake vLLMs behind one lifeguard with `engines:` on one GPU; a request for the sleeping
model is timed from its send to the first byte of its answer. That time holds the engines' own sleep and
wake (`op_ms` each, spent in the fake vLLM); what is left is ours: routing by model, the arbiter's turn,
the sleep's verification, the wake's verification, releasing the held request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import sys
import time

from benchmarks.procs import free_port, http, log, wait_until
from benchmarks.rig import HERE, Rig

MODELS = {"policy": "policy-model", "judge": "judge-model"}


async def bench_swap(rig: Rig, cycles: int, op_ms: float) -> dict[str, float]:
    ports = {name: free_port() for name in MODELS}
    for name, port in ports.items():
        rig.start(f"fake-vllm-{name}", [sys.executable, str(HERE / "upstream.py"), "--port", str(port)])
    for port in ports.values():
        await wait_until(functools.partial(_healthy, port), f"fake vLLM on port {port}")
        await http(port, "POST", f"/bench/config?op_ms={op_ms:g}")
    config = rig.workdir / "engines.yaml"
    engines = [
        {"name": name, "upstream": f"http://127.0.0.1:{port}", "gpus": [0], "models": [MODELS[name]]}
        for name, port in ports.items()
    ]
    # JSON is YAML: no YAML writer needed in the bench's own environment.
    config.write_text(json.dumps({"engines": engines, "gpu_probe": "none", "canary_enabled": False}))
    await rig.start_lifeguard_engines(config)
    # Through the proxy, so it knows the level (1): the fake vLLM has no sleep-level gauge, and an engine
    # found asleep at an unknown level may have discarded its weights, which a request never wakes.
    status, body = await http(rig.lg_port, "POST", "/engines/judge/sleep?level=1")
    if status != 200:
        raise RuntimeError(f"putting the judge to sleep answered {status}: {body[:300]!r}")
    times = []
    for _ in range(cycles):
        for name in ("judge", "policy"):  # each asks for the one asleep
            times.append(await _first_byte_ms(rig.lg_port, MODELS[name]))
    await rig.stop_lifeguard()
    swap_ms = statistics.median(times)
    result = {"swap_ms": swap_ms, "op_ms": op_ms, "swap_added_ms": swap_ms - 2 * op_ms, "swaps": len(times)}
    log(f"swap ({len(times)} swaps, engine sleep and wake {op_ms:g} ms each): median {swap_ms:.1f} ms to first byte")
    return result


async def _first_byte_ms(port: int, model: str, timeout: float = 30.0) -> float:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            t0 = time.perf_counter()
            writer.write(head.encode() + body)
            first = await reader.read(1)
            elapsed = (time.perf_counter() - t0) * 1000
            rest = await reader.read()
        finally:
            writer.close()
    answer = first + rest
    if not answer.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"a request for {model} answered {answer[:300]!r}")
    return elapsed


async def _healthy(port: int) -> bool:
    status, _ = await http(port, "GET", "/health")
    return status == 200
