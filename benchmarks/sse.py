"""SSE load: endless streams through each path, events/s, per-event latency and the proxy's CPU per event."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from benchmarks.procs import cpu_seconds, http, listen_overflows, log, median_dict, rss_bytes, run_ratios, wait_until
from benchmarks.rig import Rig

T_FIELD = re.compile(rb'"t":(\d+)')
OPENING_RATE = 20_000  # events/s in all while unpaced streams open


class SseClient(asyncio.Protocol):
    """One SSE stream: sends the request, then, while the window is open, turns every event's send stamp
    into a latency. Streams are endless; the harness closes them when the window ends."""

    def __init__(self, request: bytes, shared: SseShared) -> None:
        self.request = request
        self.shared = shared
        self.buf = b""
        self.window_events = 0
        self.flowing = False  # it has delivered an event
        self.lost: Exception | None = None
        self.closed_early = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.buf = buf
            return
        part, self.buf = buf[:cut], buf[cut + 2 :]
        sh = self.shared
        if not self.flowing:
            self.flowing = True
            sh.flowing += 1
        if not sh.measuring:
            return
        now = time.monotonic_ns()
        stamps = T_FIELD.findall(part)
        self.window_events += len(stamps)
        sh.latencies.extend(now - int(stamp) for stamp in stamps)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.shared.closing:
            self.closed_early = True
            self.lost = exc


@dataclass
class SseShared:
    measuring: bool = False
    closing: bool = False
    flowing: int = 0
    latencies: array[int] = field(default_factory=lambda: array("q"))


def percentile(sorted_values: Any, q: float) -> float:
    if not len(sorted_values):
        return math.nan
    return float(sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))])


async def sse_run(rig: Rig, target: str, streams: int, rate: float, seconds: float) -> dict[str, float]:
    """`streams` concurrent streams; the source sends `rate` events/s in all (0: as fast as it can).

    The window is a fixed time: it opens once every stream has delivered an event and a warm-up has passed, and
    closes `seconds` later, when the streams are cut. The streams are endless, so however long the
    connections take to open (a listen queue that overflows costs 1-3 s of SYN retries) or however fast
    the relay is, the window always measures all `streams` at once, and events, latencies and the proxy's
    CPU time are all taken over the same window."""
    # Unpaced, the source and this client are too busy relaying the first streams to open the last ones (of 2,048,
    # some had no event after 30 s even direct): the streams open paced and the source is unleashed once all flow.
    status, _ = await http(rig.sse_port, "POST", f"/bench/config?rate={rate or OPENING_RATE:g}")
    assert status == 200
    # Endless in practice (the harness cuts the streams), and within the u32 that vllm-router's typed
    # request parsing accepts: it answers 422 to a larger max_tokens.
    body = b'{"model":"tiny","prompt":"x","stream":true,"max_tokens":%d}' % (2**31 - 1)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    shared = SseShared()
    loop = asyncio.get_running_loop()
    pid = rig.proxy_pid(target, sse=True)
    port = rig.port(target, sse=True)
    conns: list[SseClient] = []
    overflows0 = listen_overflows()
    t0 = time.monotonic()
    try:
        for start in range(0, streams, 128):
            batch = [
                loop.create_connection(lambda: SseClient(request, shared), "127.0.0.1", port)
                for _ in range(min(128, streams - start))
            ]
            conns += [proto for _, proto in await asyncio.gather(*batch)]
        connect_s = time.monotonic() - t0
        # A connect() that returned is not a stream the proxy serves: when its listen queue overflowed, the
        # kernel drops the handshake's last ACK and the proxy sees the connection only after SYN-ACK retries.
        ready_by = t0 + 30
        while shared.flowing < streams and time.monotonic() < ready_by:
            await asyncio.sleep(0.005)
        ready_s = time.monotonic() - t0
        overflows = listen_overflows() - overflows0
        if shared.flowing < streams:
            log(f"  sse {target}: only {shared.flowing} of {streams} streams delivered an event within 30 s")
        if not rate:
            status, _ = await http(rig.sse_port, "POST", "/bench/config?rate=0")
            assert status == 200
        await asyncio.sleep(0.3 if seconds >= 2 else 0.15)  # warm-up
        cpu0 = cpu_seconds(pid) if pid else 0.0
        w0 = time.monotonic_ns()
        shared.measuring = True
        await asyncio.sleep(seconds / 2)
        rss = rss_bytes(pid) if pid else 0
        await asyncio.sleep(seconds / 2)
        shared.measuring = False
        w1 = time.monotonic_ns()
        cpu = cpu_seconds(pid) - cpu0 if pid else 0.0
    finally:
        shared.closing = True
        for c in conns:
            c.transport.close()
    await sse_drained(rig)
    early = [c for c in conns if c.closed_early]
    if early:
        raise RuntimeError(f"{target}: {len(early)} of {streams} SSE streams closed early ({early[0].lost!r})")
    idle = sum(1 for c in conns if c.window_events == 0)
    if idle:
        log(f"  sse {target} {streams} streams: {idle} stream(s) delivered nothing in the window")
    lat = sorted(shared.latencies)
    events = len(lat)
    window_s = (w1 - w0) / 1e9
    if ready_s > 0.5 or overflows:
        log(
            f"  sse {target} {streams} streams: connect() took {connect_s:.2f} s, every stream delivering "
            f"{ready_s:.2f} s ({overflows} listen-queue overflows)"
        )
    return {
        "events_per_s": events / window_s,
        "p50_us": percentile(lat, 50) / 1000,
        "p99_us": percentile(lat, 99) / 1000,
        "cpu_us_per_event": cpu / events * 1e6 if pid and events else math.nan,
        "rss": rss,
        "events": events,
        "window_s": window_s,
        "idle_streams": idle,
        "connect_ms": connect_s * 1000,
        "ready_ms": ready_s * 1000,
        "listen_overflows": overflows,
    }


async def sse_drained(rig: Rig, timeout: float = 15.0) -> None:
    """Wait until the fake vLLM has seen every cut stream go, so no relay work spills into the next run."""

    async def none_open() -> bool:
        _, raw = await http(rig.sse_port, "GET", "/bench/stats")
        return bool(json.loads(raw)["streams"] == 0)

    await wait_until(none_open, "the fake vLLM's streams to close", timeout=timeout)


async def bench_sse(rig: Rig, streams_list: tuple[int, ...], rate: float, seconds: float, reps: int) -> dict[str, Any]:
    await rig.start_lifeguards(f"http://127.0.0.1:{rig.sse_port}")
    for target in rig.paths:
        await sse_run(rig, target, 16, 5000, 0.5)
    runs: dict[str, list[dict[str, float]]] = {}
    for streams in streams_list:
        for rep in range(reps):
            for target in rig.paths:
                r = await sse_run(rig, target, streams, rate, seconds)
                runs.setdefault(f"{target}@{streams}", []).append(r)
                log(
                    f"sse {streams} streams @{rate:g}/s rep={rep + 1} {target:13s} {r['events_per_s']:8.0f} ev/s "
                    f"p50 {r['p50_us']:.0f} us p99 {r['p99_us']:.0f} us cpu {r['cpu_us_per_event']:.1f} us/ev "
                    f"({r['events']:.0f} events in {r['window_s']:.2f} s; ready {r['ready_ms']:.0f} ms)"
                )
            for target in rig.paths:  # as fast as the source can send: the relay's ceiling in this rig
                r = await sse_run(rig, target, streams, 0, seconds)
                runs.setdefault(f"{target}@{streams}max", []).append(r)
                log(
                    f"sse {streams} streams unpaced rep={rep + 1} {target:13s} {r['events_per_s']:8.0f} ev/s "
                    f"cpu {r['cpu_us_per_event']:.1f} us/ev ({r['events']:.0f} events in {r['window_s']:.2f} s; "
                    f"ready {r['ready_ms']:.0f} ms)"
                )
    await rig.stop_lifeguard()
    result: dict[str, Any] = {key: median_dict(v) for key, v in runs.items()}
    for streams in streams_list:
        # A burst of streams, every one delivering: judged on the worst repetition, not the median.
        by_path = {path: runs.get(f"{path}@{streams}", []) for path in ("lifeguard", "nginx")}
        ratios = run_ratios(by_path, "lifeguard", "nginx", "ready_ms")
        result[f"burst@{streams}"] = {"worst": ratios[-1], "best": ratios[0], "runs": len(ratios)} if ratios else {}
        # CPU per event with the source unpaced, lifeguard ÷ nginx in each repetition (the two back to back)
        by_path = {path: runs.get(f"{path}@{streams}max", []) for path in ("lifeguard", "nginx")}
        ratios = run_ratios(by_path, "lifeguard", "nginx", "cpu_us_per_event")
        result[f"cpu@{streams}"] = {"worst": ratios[-1], "best": ratios[0], "runs": len(ratios)} if ratios else {}
    return result
