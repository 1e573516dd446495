"""The proxy's own Python per forwarded request, in one process and without sockets: the front's protocol and a
pooled upstream connection driven with stand-in transports, so that what is timed is lifeguard's code on the
request path (llhttp's parsing included) and nothing of the kernel, the loop or the load generator.

One request = a client's completion request fed to `FrontConnection.data_received`, then vLLM's answer fed to the
`UpstreamConnection` the request was written to, until the answer is written to the client. `--stream`: one SSE
event of a stream already relayed (one chunk from vLLM to the client). The engine is found RUNNING first, in
front of the embedded simulator. Prints the best of 5 runs in µs (wall clock, and the thread's CPU time, which
waiting for a shared core does not inflate); `--profile` adds cProfile's table (slower per
call, for the shape). `--proxy-src DIR` times another checkout's `proxy` (how docs/performance.md's steps were
measured). Usage: .venv/bin/python -m benchmarks.hotpath [--stream] [--profile] [--proxy-src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

BODY = b'{"model":"tiny","prompt":"The capital of France is","max_tokens":2}'
STREAM_BODY = b'{"model":"tiny","prompt":"The capital of France is","max_tokens":2,"stream":true}'
ANSWER = (
    b'{"id":"cmpl-bench","object":"text_completion","created":1700000000,"model":"tiny","choices":[{"index":0,'
    b'"text":" Paris.","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"total_tokens":7,'
    b'"completion_tokens":2}}'
)
# As nginx answers in make bench's fixed load (benchmarks/nginx-upstream.conf.in).
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Sun, 06 Dec 2026 02:33:22 GMT\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%b" % (len(ANSWER), ANSWER)
)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,'
    b'"text":" x","logprobs":null,"finish_reason":null}]}\n\n'
)
EVENT_CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)


def request(body: bytes) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)


class StandInTransport(asyncio.Transport):
    """Keeps what is written; reading and writing are never paused."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def best_of(runs: int, count: int, step: Callable[[], None], between: Callable[[], None]) -> tuple[float, float]:
    """The fastest of `runs` timings of `count` steps, in µs per step: wall-clock time, and this thread's CPU time
    (which time spent waiting for a core shared with other work does not inflate)."""
    best = best_cpu = float("inf")
    for _ in range(runs):
        started, started_cpu = time.perf_counter(), time.thread_time()
        for _ in range(count):
            step()
        best = min(best, (time.perf_counter() - started) / count * 1e6)
        best_cpu = min(best_cpu, (time.thread_time() - started_cpu) / count * 1e6)
        between()
    return best, best_cpu


async def measure(args: argparse.Namespace) -> None:
    from aiohttp import web

    from lifeguard_sim.app import SimSettings, create_sim_app
    from proxy.app import Lifeguard
    from proxy.config import Settings
    from proxy.upstream.pool import UpstreamConnection

    sim = web.AppRunner(create_sim_app(SimSettings()), handle_signals=False)
    await sim.setup()
    await web.TCPSite(sim, "127.0.0.1", 0).start()
    port = sim.addresses[0][1]
    lifeguard = Lifeguard(Settings(upstream=f"http://127.0.0.1:{port}", gpu_probe="none", canary_enabled=False))
    await lifeguard.start("127.0.0.1", 0)
    engine = lifeguard.engines["default"]
    async with asyncio.timeout(20):
        while engine.coordinator.record.view().state.value != "RUNNING":
            await asyncio.sleep(0.05)
    assert lifeguard.front is not None
    pool = engine.upstream.pool
    vllm_side = StandInTransport()
    upstream: Any = UpstreamConnection(pool)
    upstream.connection_made(vllm_side)
    pool._open += 1  # an idle connection of the pool's own, as if it had opened it
    upstream.reusable = True
    upstream.release()
    client_side = StandInTransport()
    client: Any = lifeguard.front.protocol()
    client.connection_made(client_side)

    if args.stream:
        client.data_received(request(STREAM_BODY))
        upstream.data_received(STREAM_HEAD)
        upstream.data_received(EVENT_CHUNK)

        def step() -> None:
            upstream.data_received(EVENT_CHUNK)

        what = "SSE event"
    else:
        whole = request(BODY)

        def step() -> None:
            client.data_received(whole)
            upstream.data_received(RESPONSE)

        what = "forwarded request"
    step()
    expected = b"%x\r\n" % len(EVENT) if args.stream else b"HTTP/1.1 200 "
    if not client_side.written or not client_side.written[-1].startswith(expected):
        raise SystemExit(f"the stand-in {what} was not relayed: {client_side.written[-1:]!r}")

    def forget() -> None:
        client_side.written.clear()
        vllm_side.written.clear()

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.count // 5):
            step()
        profile.disable()
        forget()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    micros, cpu = best_of(5, args.count, step, forget)
    print(f"{args.proxy_src}: {micros:.2f} µs of Python per {what}, {cpu:.2f} µs of CPU time", end=" ")
    print(f"(best of 5 runs of {args.count})")
    await lifeguard.close()
    await sim.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy-src", default=str(ROOT), help="checkout whose `proxy` package is timed")
    parser.add_argument("--stream", action="store_true", help="one SSE event of a stream, not one whole request")
    parser.add_argument("--profile", action="store_true", help="print cProfile's table too")
    parser.add_argument("--count", type=int, default=50_000)
    args = parser.parse_args()
    sys.path[:0] = [args.proxy_src, str(ROOT)]
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
