"""Hold and release: many requests held while the engine sleeps, then one wake through the proxy."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from benchmarks.fixed import wrk
from benchmarks.procs import cpu_seconds, http, log, median_dict, rss_bytes, wait_until
from benchmarks.rig import Rig

COMPLETION_BODY = b'{"model":"tiny","prompt":"The capital of France is","max_tokens":2}'


class HeldClient(asyncio.Protocol):
    """One client connection that sends one completion request when told and waits for the answer."""

    def __init__(self) -> None:
        self.buf = b""
        self.status = 0
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        self.transport.write(head + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION_BODY), COMPLETION_BODY))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.done.done():
            return
        head = self.buf[:end].lower()
        match = re.search(rb"content-length: *(\d+)", head)
        if match is None or len(self.buf) >= end + 4 + int(match.group(1)):
            self.status = int(self.buf.split(b" ", 2)[1])
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def lifeguard_state(rig: Rig) -> dict[str, Any]:
    status, body = await http(rig.lg_port, "GET", "/lifeguard/state")
    result: dict[str, Any] = json.loads(body)
    return result


async def hold_run(rig: Rig, count: int, seconds: float) -> dict[str, float]:
    lg = await rig.start_lifeguard(rig.sse_port)
    await wrk(rig.lg_port, 16, 1, None)  # warm, so that RSS deltas are about holding, not first use
    await asyncio.sleep(0.3)
    rss0 = rss_bytes(lg.pid)
    status, body = await http(rig.lg_port, "POST", "/sleep?level=1")
    if status != 200:
        raise RuntimeError(f"sleep through the proxy answered {status}: {body[:300]!r}")
    loop = asyncio.get_running_loop()
    clients: list[HeldClient] = []
    for start in range(0, count, 250):
        batch = [loop.create_connection(HeldClient, "127.0.0.1", rig.lg_port) for _ in range(min(250, count - start))]
        clients += [proto for _, proto in await asyncio.gather(*batch)]
    await asyncio.sleep(0.5)
    rss1 = rss_bytes(lg.pid)
    for c in clients:
        c.send()

    async def all_held() -> bool:
        return bool((await lifeguard_state(rig))["held_requests"] >= count)

    await wait_until(all_held, f"{count} held requests", timeout=120)
    await asyncio.sleep(0.3)
    rss2 = rss_bytes(lg.pid)
    await http(rig.sse_port, "POST", "/bench/reset")
    cpu0 = cpu_seconds(lg.pid)
    t_wake = time.monotonic_ns()
    status, body = await http(rig.lg_port, "POST", "/wake_up", timeout=120)
    t_answered = time.monotonic_ns()
    if status != 200:
        raise RuntimeError(f"wake through the proxy answered {status}: {body[:300]!r}")
    async with asyncio.timeout(180):
        await asyncio.gather(*(c.done for c in clients))
    cpu = cpu_seconds(lg.pid) - cpu0
    _, raw = await http(rig.sse_port, "GET", "/bench/stats")
    stats = json.loads(raw)
    ok = sum(1 for c in clients if c.status == 200)
    if ok < count:
        statuses: dict[int, int] = {}
        for c in clients:
            statuses[c.status] = statuses.get(c.status, 0) + 1
        log(f"  held requests by answer status (0: connection closed): {dict(sorted(statuses.items()))}")
    for c in clients:
        c.transport.close()
    wake_end = stats["wake_done_ns"]
    steady = await wrk(rig.lg_port, 256, seconds, lg.pid)
    await rig.stop_lifeguard()
    return {
        "ok": ok,
        "forwarded": stats["count"],
        "first_ms": (stats["first_ns"] - wake_end) / 1e6,
        "verified_ms": (stats["flag_ns"] - wake_end) / 1e6,
        "release_ms": (stats["first_ns"] - stats["flag_ns"]) / 1e6,
        "last_ms": (stats["last_ns"] - wake_end) / 1e6,
        "wake_call_ms": (t_answered - t_wake) / 1e6,
        "drain_rps": stats["count"] / max((stats["last_ns"] - wake_end) / 1e9, 1e-9),
        "steady_rps": steady["rps"],
        "cpu_us_per_req": cpu / max(stats["count"], 1) * 1e6,
        "bytes_per_conn": (rss1 - rss0) / count,
        "bytes_per_held": (rss2 - rss1) / count,
        "bytes_per_held_client": (rss2 - rss0) / count,
    }


async def bench_hold(rig: Rig, count: int, seconds: float, reps: int) -> dict[str, float]:
    runs = []
    for rep in range(reps):
        r = await hold_run(rig, count, seconds)
        runs.append(r)
        log(
            f"hold {count} rep={rep + 1}: {r['ok']} answered 200; first forwarded {r['first_ms']:.2f} ms, last "
            f"{r['last_ms']:.0f} ms after the wake; drain {r['drain_rps']:.0f}/s vs steady {r['steady_rps']:.0f}/s; "
            f"{r['bytes_per_held_client']:.0f} B per held client ({r['bytes_per_held']:.0f} B beyond its connection)"
        )
    return median_dict(runs)
