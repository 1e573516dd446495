"""The release burst (issue 39): streamed completions held through a weight sync, released at the verified resume.

Through lifeguard (a fresh process each repetition, in front of the fake vLLM): `/pause?mode=keep`, then `count`
clients each send a streamed completion and are held, then `/start_weight_update`, `/update_weights`,
`/finish_weight_update` and `/resume`; timed from the resume's 200 (as this client receives it) to the last
stream's first byte. Through nginx (which cannot hold: the fair limit): `count` fresh streams to the same fake
vLLM, their connections opened first and their requests sent at once, timed from the send to the last first byte.
Every stream must end with `[DONE]` after a 200; lifeguard's peak RSS (VmHWM) is its process's peak over the run.
The two alternate, the order reversed every other repetition; judged on the worst repetition.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from benchmarks.hold import lifeguard_state
from benchmarks.procs import http, log, median_dict, rss_bytes, run_ratios, wait_until
from benchmarks.rig import Rig
from benchmarks.sse import sse_drained

BODY = b'{"model":"tiny","prompt":"The capital of France is","max_tokens":4,"stream":true}'
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
REQUEST += b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
WEIGHT_SYNC = (
    ("/start_weight_update", b""),
    ("/update_weights", b'{"update_info":{}}'),
    ("/finish_weight_update", b""),
)


class StreamClient(asyncio.Protocol):
    """One streamed completion: when its answer's first byte came, its status, whether it ended (`[DONE]` and
    the last chunk, or any other status: a failure)."""

    def __init__(self) -> None:
        self.first_ns = 0
        self.status = 0
        self.tail = b""
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.first_ns:
            self.first_ns = time.monotonic_ns()
        self.tail = (self.tail + data)[-64:] if self.status else self.tail + data
        if not self.status and b"\r\n" in self.tail:
            self.status = int(self.tail.split(b" ", 2)[1])
        if self.status and (self.status != 200 or b"data: [DONE]" in self.tail and self.tail.endswith(b"0\r\n\r\n")):
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    @property
    def ok(self) -> bool:
        return self.status == 200 and b"data: [DONE]" in self.tail


async def connect(port: int, count: int) -> list[StreamClient]:
    loop = asyncio.get_running_loop()
    clients: list[StreamClient] = []
    for start in range(0, count, 128):  # as sse.py opens its streams
        batch = [loop.create_connection(StreamClient, "127.0.0.1", port) for _ in range(min(128, count - start))]
        clients += [proto for _, proto in await asyncio.gather(*batch)]
    return clients


async def finish(rig: Rig, clients: list[StreamClient], since_ns: int) -> dict[str, float]:
    """Wait for every stream (bounded), then the figures of the run, its clients closed."""
    try:
        async with asyncio.timeout(120):
            await asyncio.gather(*(c.done for c in clients))
    except TimeoutError:
        log(f"  release: {sum(1 for c in clients if not c.done.done())} stream(s) had not ended after 120 s")
    firsts = [c.first_ns for c in clients if c.first_ns]
    result = {
        "last_first_ms": (max(firsts) - since_ns) / 1e6 if len(firsts) == len(clients) else float("inf"),
        "ok": sum(1 for c in clients if c.ok),
        "server_errors": sum(1 for c in clients if c.status >= 500),
        "no_first_byte": len(clients) - len(firsts),
    }
    for c in clients:
        c.transport.close()
    await sse_drained(rig)
    return result


async def through_nginx(rig: Rig, count: int) -> dict[str, float]:
    clients = await connect(rig.port("nginx", sse=True), count)
    sent = time.monotonic_ns()
    for c in clients:
        c.transport.write(REQUEST)
    return await finish(rig, clients, sent)


async def through_lifeguard(rig: Rig, count: int) -> dict[str, float]:
    lg = await rig.start_lifeguard(rig.sse_port)  # fresh: its VmHWM is this run's peak
    port = rig.lg_port

    async def post(path: str, body: bytes = b"") -> None:
        status, answer = await http(port, "POST", path, body)
        if status != 200:
            raise RuntimeError(f"{path} through the proxy answered {status}: {answer[:300]!r}")

    await post("/pause?mode=keep")
    clients = await connect(port, count)
    for c in clients:
        c.transport.write(REQUEST)

    async def all_held() -> bool:
        return bool((await lifeguard_state(rig))["held_requests"] >= count)

    await wait_until(all_held, f"{count} held streams", timeout=60)
    rss_held = rss_bytes(lg.pid)
    for path, body in WEIGHT_SYNC:
        await post(path, body)
    await post("/resume")
    resumed = time.monotonic_ns()
    result = await finish(rig, clients, resumed)
    result["peak_rss"] = rss_bytes(lg.pid, "VmHWM")
    result["rss_held"] = rss_held
    state = await lifeguard_state(rig)
    await rig.stop_lifeguard()
    if state["state"] != "RUNNING":
        raise RuntimeError(f"lifeguard ended the release burst in {state['state']}: {json.dumps(state)[:300]}")
    return result


async def bench_release(rig: Rig, count: int, reps: int) -> dict[str, Any]:
    status, _ = await http(rig.sse_port, "POST", "/bench/config?rate=0")
    assert status == 200
    runs: dict[str, list[dict[str, float]]] = {}
    legs = {"nginx": through_nginx, "lifeguard": through_lifeguard}
    for rep in range(reps):
        for path in list(legs) if rep % 2 == 0 else list(reversed(legs)):
            r = await legs[path](rig, count)
            runs.setdefault(path, []).append(r)
            log(
                f"release {count} rep={rep + 1} {path:10s} last first byte {r['last_first_ms']:.0f} ms; "
                f"{r['ok']:.0f} streams to [DONE], {r['server_errors']:.0f} 5xx"
                + (f"; peak RSS {r['peak_rss'] / 2**20:.1f} MiB" if "peak_rss" in r else "")
            )
    ratios = run_ratios(runs, "lifeguard", "nginx", "last_first_ms")
    lifeguard = runs["lifeguard"]
    return {
        **{path: median_dict(r) for path, r in runs.items()},
        "ratios": ratios,
        "count": count,
        "answered_share": min(r["ok"] for r in lifeguard) / count,
        "server_errors": sum(r["server_errors"] for r in lifeguard),
        "peak_rss_max": max(r["peak_rss"] for r in lifeguard),
    }
