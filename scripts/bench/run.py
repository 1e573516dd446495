"""The performance table (`make bench`): direct to a trivial upstream, through nginx, through vllm-lifeguard.

Everything runs on loopback, started and stopped here, under one temp directory:
* nginx as the trivial upstream (fixed completion body, vLLM's flag routes), one worker;
* `upstream.py`, a raw-asyncio fake vLLM for what nginx cannot do: paced SSE streams with a send
  timestamp in every event, and `/sleep` / `/wake_up` that flip its flags;
* nginx as a reverse proxy in front of both (one worker: one proxy process against one proxy process);
* vllm-lifeguard (`python -m proxy serve`, from this checkout or `--proxy-src`), one process.
Load comes from wrk (non-streaming) and from asyncio clients in this process (SSE, held requests).

Figures are medians over `--reps` interleaved repetitions. CPU time per request is read from
/proc/PID/stat around each run, so it holds even when other work shares the cores; throughput and
latency do not, so the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TICK = os.sysconf("SC_CLK_TCK")
TARGETS = ("direct", "nginx", "lifeguard")
COMPLETION_BODY = b'{"model":"tiny","prompt":"The capital of France is","max_tokens":2}'


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


class Proc:
    """A child process with its output in a log file; `stop()` ends it (TERM, then KILL)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, *, cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd)
        self.pid = self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# ------------------------------------------------------------------------------------------------ plain HTTP


async def http(port: int, method: str, path: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """One request on its own connection; returns status and body (answers must have a Content-Length)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            raw = await reader.readuntil(b"\r\n\r\n")
            match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", raw)
            payload = await reader.readexactly(int(match.group(1))) if match else b""
        finally:
            writer.close()
    return int(raw.split(b" ", 2)[1]), payload


async def wait_until(check: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what} ({last!r})")


# --------------------------------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    workdir: Path
    proxy_src: Path
    up_port: int = field(default_factory=free_port)
    sse_port: int = field(default_factory=free_port)
    nginx_port: int = field(default_factory=free_port)
    nginx_sse_port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    nginx_worker: int = 0
    lg: Proc | None = None
    lg_port: int = 0

    def render(self, template: str, out: str, **values: int | str) -> Path:
        text = (HERE / template).read_text()
        for key, value in values.items():
            text = text.replace(f"@{key}@", str(value))
        path = self.workdir / out
        path.write_text(text)
        return path

    def start(self, name: str, argv: list[str], **kw: Any) -> Proc:
        proc = Proc(name, argv, self.workdir, **kw)
        self.procs.append(proc)
        return proc

    async def start_fixed(self) -> None:
        for sub in ("tmp-body", "tmp-proxy", "tmp-fastcgi", "tmp-uwsgi", "tmp-scgi"):
            (self.workdir / sub).mkdir(exist_ok=True)
        prefix = str(self.workdir)
        up = self.render("nginx-upstream.conf.in", "nginx-upstream.conf", PREFIX=prefix, PORT=self.up_port)
        self.start("nginx-upstream", ["nginx", "-p", prefix, "-e", f"{prefix}/nginx-e1.log", "-c", str(up)])
        self.start("fake-vllm", [sys.executable, str(HERE / "upstream.py"), "--port", str(self.sse_port)])
        px = self.render(
            "nginx-proxy.conf.in",
            "nginx-proxy.conf",
            PREFIX=prefix,
            PORT=self.nginx_port,
            PORT_SSE=self.nginx_sse_port,
            UPSTREAM_PORT=self.up_port,
            SSE_PORT=self.sse_port,
        )
        master = self.start("nginx-proxy", ["nginx", "-p", prefix, "-e", f"{prefix}/nginx-e2.log", "-c", str(px)])
        for port in (self.up_port, self.sse_port, self.nginx_port):
            await wait_until(lambda p=port: _ok(http(p, "GET", "/health")), f"port {port}")
        workers = children(master.pid)
        if len(workers) != 1:
            raise RuntimeError(f"expected one nginx proxy worker, found {workers}")
        self.nginx_worker = workers[0]

    async def start_lifeguard(self, upstream_port: int) -> Proc:
        await self.stop_lifeguard()
        self.lg_port = free_port()
        argv = [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{upstream_port}"]
        argv += ["--port", str(self.lg_port), "--gpu-probe", "none", "--no-canary", "--log-level", "warning"]
        self.lg = self.start("lifeguard", argv, cwd=self.proxy_src)

        async def running() -> bool:
            status, body = await http(self.lg_port, "GET", "/lifeguard/state", timeout=2)
            return status == 200 and json.loads(body)["state"] == "RUNNING"

        try:
            await wait_until(running, "vllm-lifeguard to reach RUNNING")
        except RuntimeError:
            log(self.lg.tail())
            raise
        return self.lg

    async def stop_lifeguard(self) -> None:
        if self.lg is not None:
            self.lg.stop()
            self.procs.remove(self.lg)
            self.lg = None

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def port(self, target: str, *, sse: bool = False) -> int:
        if target == "direct":
            return self.sse_port if sse else self.up_port
        if target == "nginx":
            return self.nginx_sse_port if sse else self.nginx_port
        return self.lg_port

    def proxy_pid(self, target: str) -> int | None:
        if target == "nginx":
            return self.nginx_worker
        if target == "lifeguard" and self.lg is not None:
            return self.lg.pid
        return None


async def _ok(coro: Any) -> bool:
    status, _ = await coro
    return bool(status == 200)


# -------------------------------------------------------------------------------------------- non-streaming


async def wrk(port: int, conns: int, seconds: float, pid: int | None) -> dict[str, float]:
    """One wrk run; adds the proxy's CPU seconds and its RSS sampled half-way."""
    argv = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(HERE / "wrk-post.lua")]
    argv.append(f"http://127.0.0.1:{port}/v1/completions")
    cpu0 = cpu_seconds(pid) if pid else 0.0
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await asyncio.sleep(seconds / 2)
    rss = rss_bytes(pid) if pid else 0
    out, err = await proc.communicate()
    cpu = cpu_seconds(pid) - cpu0 if pid else 0.0
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
    await rig.start_lifeguard(rig.up_port)
    for target in TARGETS:  # warm every path (connection pools, lazily imported code)
        await wrk(rig.port(target), 16, 1, None)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for conns in conns_list:
        for rep in range(reps):
            for target in TARGETS:
                result = await wrk(rig.port(target), conns, seconds, rig.proxy_pid(target))
                runs.setdefault((target, conns), []).append(result)
                log(
                    f"fixed c={conns} rep={rep + 1} {target:9s} {result['rps']:8.0f} req/s "
                    f"p50 {result['p50_us'] / 1000:.3f} ms p99 {result['p99_us'] / 1000:.3f} ms "
                    f"cpu {result['cpu_us_per_req']:.0f} us/req"
                )
    await rig.stop_lifeguard()
    return {f"{t}@{c}": _median_dict(v) for (t, c), v in runs.items()}


def _median_dict(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


# ---------------------------------------------------------------------------------------------------- SSE

T_FIELD = re.compile(rb'"t":(\d+)')


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
    latencies: array = field(default_factory=lambda: array("q"))


def percentile(sorted_values: Any, q: float) -> float:
    if not len(sorted_values):
        return math.nan
    return float(sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))])


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (TcpExt ListenOverflows)."""
    with contextlib.suppress(OSError), open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            if head.startswith("TcpExt:"):
                return int(dict(zip(head.split(), values.split(), strict=True)).get("ListenOverflows", 0))
    return 0


async def sse_run(rig: Rig, target: str, streams: int, rate: float, seconds: float) -> dict[str, float]:
    """`streams` concurrent streams; the source sends `rate` events/s in all (0: as fast as it can).

    The window is a fixed time: it opens once every stream has delivered an event and a warm-up has passed, and
    closes `seconds` later, when the streams are cut. The streams are endless, so however long the
    connections take to open (a listen queue that overflows costs 1-3 s of SYN retries) or however fast
    the relay is, the window always measures all `streams` at once, and events, latencies and the proxy's
    CPU time are all taken over the same window."""
    status, _ = await http(rig.sse_port, "POST", f"/bench/config?rate={rate:g}")
    assert status == 200
    body = b'{"model":"tiny","prompt":"x","stream":true,"max_tokens":%d}' % 10**12
    request = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    shared = SseShared()
    loop = asyncio.get_running_loop()
    pid = rig.proxy_pid(target)
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
    await rig.start_lifeguard(rig.sse_port)
    for target in TARGETS:
        await sse_run(rig, target, 16, 5000, 0.5)
    runs: dict[str, list[dict[str, float]]] = {}
    for streams in streams_list:
        for rep in range(reps):
            for target in TARGETS:
                r = await sse_run(rig, target, streams, rate, seconds)
                runs.setdefault(f"{target}@{streams}", []).append(r)
                log(
                    f"sse {streams} streams @{rate:g}/s rep={rep + 1} {target:9s} {r['events_per_s']:8.0f} ev/s "
                    f"p50 {r['p50_us']:.0f} us p99 {r['p99_us']:.0f} us cpu {r['cpu_us_per_event']:.1f} us/ev "
                    f"({r['events']:.0f} events in {r['window_s']:.2f} s; ready {r['ready_ms']:.0f} ms)"
                )
            for target in TARGETS:  # as fast as the source can send: the relay's ceiling in this rig
                r = await sse_run(rig, target, streams, 0, seconds)
                runs.setdefault(f"{target}@{streams}max", []).append(r)
                log(
                    f"sse {streams} streams unpaced rep={rep + 1} {target:9s} {r['events_per_s']:8.0f} ev/s "
                    f"cpu {r['cpu_us_per_event']:.1f} us/ev ({r['events']:.0f} events in {r['window_s']:.2f} s; "
                    f"ready {r['ready_ms']:.0f} ms)"
                )
    await rig.stop_lifeguard()
    return {key: _median_dict(v) for key, v in runs.items()}


# ------------------------------------------------------------------------------------------ held requests


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
    return _median_dict(runs)


# ---------------------------------------------------------------------------------------------- lifecycle


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


# -------------------------------------------------------------------------------------------------- report


def fmt(value: float, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "ms":
        return f"{value:.3f} ms" if abs(value) < 10 else f"{value:.1f} ms"
    if unit == "us":
        return f"{value:.0f} µs"
    if unit == "MiB":
        return f"{value / 2**20:.1f} MiB"
    if unit == "x":
        return f"{value:.2f}×"
    if unit == "B":
        return f"{value:,.0f} B"
    return f"{value:,.0f}{(' ' + unit) if unit else ''}"


def delta(value: float) -> str:
    """A signed difference in ms."""
    if not ok_(value):
        return "-"
    return ("+" if value >= 0 else "−") + fmt(abs(value), "ms")


def verdict(ok: bool | None) -> str:
    return "" if ok is None else ("met" if ok else "**missed**")


def ok_(value: Any) -> bool:
    """A figure that was measured (not missing, not nan, not infinite)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def ratio(a: float, b: float) -> float:
    return a / b if ok_(a) and ok_(b) and b else math.nan


def judged(value: float, test: Callable[[float], bool]) -> bool | None:
    """A verdict only for a figure that was measured: an unmeasured one is neither met nor missed."""
    return test(value) if ok_(value) else None


def per_event(us: float) -> str:
    """CPU µs per SSE event, and the events/s one core would relay at that cost."""
    if not ok_(us) or us <= 0:
        return "-"
    return f"{us:.1f} µs (→ {1e6 / us:,.0f})"


def build_table(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows: list[list[str]] = []
    fixed = res.get("fixed", {})
    for c in args.conns:
        d, n, lg = fixed.get(f"direct@{c}"), fixed.get(f"nginx@{c}"), fixed.get(f"lifeguard@{c}")
        if not (d and n and lg):
            continue
        vs_nginx = ratio(lg["rps"], n["rps"])
        target = "≥ 0.3× nginx" if c == 64 else ""
        rows.append(
            [
                f"req/s, {c} conn",
                fmt(d["rps"]),
                fmt(n["rps"]),
                fmt(lg["rps"]),
                fmt(ratio(lg["rps"], d["rps"]), "x"),
                fmt(vs_nginx, "x"),
                target,
                verdict(judged(vs_nginx, lambda v: v >= 0.3) if c == 64 else None),
            ]
        )
        for q in ("p50", "p99"):
            added_nginx = (lg[f"{q}_us"] - n[f"{q}_us"]) / 1000
            target, ok = "", None
            if c == 1 and q == "p50":
                target, ok = "+≤ 0.2 ms over nginx", added_nginx <= 0.2
            if c == 256 and q == "p99":
                target, ok = "+≤ 2 ms over nginx", added_nginx <= 2
            rows.append(
                [
                    f"{q} latency, {c} conn",
                    fmt(d[f"{q}_us"] / 1000, "ms"),
                    fmt(n[f"{q}_us"] / 1000, "ms"),
                    fmt(lg[f"{q}_us"] / 1000, "ms"),
                    delta((lg[f"{q}_us"] - d[f"{q}_us"]) / 1000),
                    delta(added_nginx),
                    target,
                    verdict(ok),
                ]
            )
    mid = 64 if 64 in args.conns else args.conns[-1]
    if fixed.get(f"lifeguard@{mid}"):
        n, lg = fixed[f"nginx@{mid}"], fixed[f"lifeguard@{mid}"]
        rows.append(
            [
                f"proxy CPU per request, {mid} conn",
                "",
                fmt(n["cpu_us_per_req"], "us"),
                fmt(lg["cpu_us_per_req"], "us"),
                "",
                fmt(ratio(lg["cpu_us_per_req"], n["cpu_us_per_req"]), "x"),
                "",
                "",
            ]
        )
    top = args.conns[-1]
    if fixed.get(f"lifeguard@{top}"):
        n, lg = fixed[f"nginx@{top}"], fixed[f"lifeguard@{top}"]
        rows.append(
            [f"proxy RSS under load, {top} conn", "", fmt(n["rss"], "MiB"), fmt(lg["rss"], "MiB"), "", "", "", ""]
        )
    sse = res.get("sse", {})
    for s in args.streams:
        d, n, lg = sse.get(f"direct@{s}max"), sse.get(f"nginx@{s}max"), sse.get(f"lifeguard@{s}max")
        if d and n and lg:
            rows.append(
                [
                    f"SSE events/s relayed, {s} streams, source unpaced",
                    fmt(d["events_per_s"]),
                    fmt(n["events_per_s"]),
                    fmt(lg["events_per_s"]),
                    fmt(ratio(lg["events_per_s"], d["events_per_s"]), "x"),
                    fmt(ratio(lg["events_per_s"], n["events_per_s"]), "x"),
                    "≥ 50,000/s",
                    verdict(judged(lg["events_per_s"], lambda v: v >= 50_000)),
                ]
            )
            rows.append(
                [
                    f"proxy CPU per SSE event (→ events/s per core), {s} streams",
                    "",
                    per_event(n["cpu_us_per_event"]),
                    per_event(lg["cpu_us_per_event"]),
                    "",
                    fmt(ratio(lg["cpu_us_per_event"], n["cpu_us_per_event"]), "x"),
                    "≥ 50,000/s",
                    verdict(judged(lg["cpu_us_per_event"], lambda v: v > 0 and 1e6 / v >= 50_000)),
                ]
            )
        d, n, lg = sse.get(f"direct@{s}"), sse.get(f"nginx@{s}"), sse.get(f"lifeguard@{s}")
        if not (d and n and lg):
            continue
        rows.append(
            [
                f"SSE events/s, {s} streams, source paced at {args.sse_rate:,.0f}/s",
                fmt(d["events_per_s"]),
                fmt(n["events_per_s"]),
                fmt(lg["events_per_s"]),
                fmt(ratio(lg["events_per_s"], d["events_per_s"]), "x"),
                fmt(ratio(lg["events_per_s"], n["events_per_s"]), "x"),
                "",
                "",
            ]
        )
        for q in ("p50", "p99"):
            rows.append(
                [
                    f"SSE per-event {q} latency, {s} streams, paced",
                    fmt(d[f"{q}_us"] / 1000, "ms"),
                    fmt(n[f"{q}_us"] / 1000, "ms"),
                    fmt(lg[f"{q}_us"] / 1000, "ms"),
                    delta((lg[f"{q}_us"] - d[f"{q}_us"]) / 1000),
                    delta((lg[f"{q}_us"] - n[f"{q}_us"]) / 1000),
                    "",
                    "",
                ]
            )
        if "ready_ms" in lg:
            rows.append(
                [
                    f"SSE: {s} streams opened at once → every one delivering, paced",
                    fmt(d["ready_ms"], "ms"),
                    fmt(n["ready_ms"], "ms"),
                    fmt(lg["ready_ms"], "ms"),
                    delta(lg["ready_ms"] - d["ready_ms"]),
                    delta(lg["ready_ms"] - n["ready_ms"]),
                    "",
                    "",
                ]
            )
    hold = res.get("hold")
    if hold:
        n_held = args.held
        rows += [
            [
                f"hold: wake end → first of {n_held:,} forwarded",
                "",
                "",
                fmt(hold["first_ms"], "ms"),
                "",
                "",
                "≤ 5 ms",
                verdict(hold["first_ms"] <= 5),
            ],
            [
                "… of which verification (wake end → flags read)",
                "",
                "",
                fmt(hold["verified_ms"], "ms"),
                "",
                "",
                "",
                "",
            ],
            [
                "… of which the release (flags read → first forwarded)",
                "",
                "",
                fmt(hold["release_ms"], "ms"),
                "",
                "",
                "",
                "",
            ],
            [f"hold: wake end → last of {n_held:,} forwarded", "", "", fmt(hold["last_ms"], "ms"), "", "", "", ""],
            [
                "hold: drain rate vs steady state (256 conn)",
                "",
                "",
                f"{fmt(hold['drain_rps'])} vs {fmt(hold['steady_rps'])}/s",
                "",
                "",
                "≥ steady",
                verdict(hold["drain_rps"] >= hold["steady_rps"] and hold["ok"] == n_held),
            ],
            [
                "hold: held requests answered 200",
                "",
                "",
                f"{hold['ok']:,.0f} of {n_held:,}",
                "",
                "",
                "all",
                verdict(hold["ok"] == n_held),
            ],
            [
                "hold: memory per held request (RSS Δ / count)",
                "",
                "",
                fmt(hold["bytes_per_held_client"], "B"),
                "",
                "",
                "< 2 KB",
                verdict(hold["bytes_per_held_client"] < 2048),
            ],
            [
                "… of which the open client connection",
                "",
                "",
                fmt(hold["bytes_per_conn"], "B"),
                "",
                "",
                "",
                "",
            ],
            ["… of which the held request itself", "", "", fmt(hold["bytes_per_held"], "B"), "", "", "", ""],
        ]
    lc = res.get("lifecycle")
    if lc:
        for op in ("sleep", "wake"):
            added = lc[f"lifeguard_{op}_ms"] - lc[f"direct_{op}_ms"]
            rows.append(
                [
                    f"lifecycle: {op} (engine op {lc['op_ms']:g} ms)",
                    fmt(lc[f"direct_{op}_ms"], "ms"),
                    "",
                    fmt(lc[f"lifeguard_{op}_ms"], "ms"),
                    delta(added),
                    "",
                    "+≤ 50 ms",
                    verdict(added <= 50),
                ]
            )
    head = ["figure", "direct", "nginx proxy", "vllm-lifeguard", "lifeguard vs direct", "lifeguard vs nginx"]
    head += ["target", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def machine() -> str:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = open("/proc/loadavg").read().split()[:3]
    return f"{os.cpu_count()} CPUs ({model}), load average {' '.join(load)}"


# ---------------------------------------------------------------------------------------------------- main


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lifeguard-bench."))
    try:
        yield path
    finally:
        if keep:
            log(f"logs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    res: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
    log(f"machine: {res['machine']}; vllm-lifeguard from {args.proxy_src}")
    with workdir(args.keep) as wd:
        rig = Rig(wd, Path(args.proxy_src).resolve())
        try:
            await rig.start_fixed()
            if "fixed" in args.only:
                res["fixed"] = await bench_fixed(rig, tuple(args.conns), args.seconds, args.reps)
            if "sse" in args.only:
                res["sse"] = await bench_sse(rig, tuple(args.streams), args.sse_rate, args.sse_seconds, args.reps)
            if "lifecycle" in args.only:
                res["lifecycle"] = await bench_lifecycle(rig, args.cycles, args.op_ms)
            if "hold" in args.only:
                res["hold"] = await bench_hold(rig, args.held, args.seconds, args.hold_reps)
        except Exception:
            for proc in rig.procs:
                log(f"--- {proc.name} log tail:\n{proc.tail()}")
            raise
        finally:
            rig.stop_all()
    res["load_after"] = open("/proc/loadavg").read().split()[:3]
    res["seconds"] = time.monotonic() - started
    print()
    print(f"vllm-lifeguard performance — {res['machine']} (after: {' '.join(res['load_after'])})")
    print(f"run took {res['seconds']:.0f} s; medians of {args.reps} run(s)" + (" (quick)" if args.quick else ""))
    print()
    for line in build_table(res, args):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short repetition of everything, 2,000 held (< 2 min)")
    parser.add_argument("--proxy-src", default=str(ROOT), help="checkout whose `proxy` package is benchmarked")
    parser.add_argument("--only", default="fixed,sse,lifecycle,hold", help="comma list: fixed,sse,lifecycle,hold")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one wrk run")
    parser.add_argument("--conns", default="1,64,256")
    parser.add_argument("--streams", default="64,512")
    parser.add_argument(
        "--sse-rate", type=float, default=20_000, help="events/s the SSE source offers in all, for the latency rows"
    )
    parser.add_argument("--sse-seconds", type=float, default=4.0)
    parser.add_argument("--held", type=int, default=10_000)
    parser.add_argument("--hold-reps", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--op-ms", type=float, default=10.0, help="the fake engine's own sleep/wake time")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir with every process's log")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.hold_reps, args.seconds, args.sse_seconds, args.cycles = 1, 1, 2.0, 2.0, 8
        args.held = min(args.held, 2_000)
    args.only = set(args.only.split(","))
    args.conns = [int(c) for c in str(args.conns).split(",")]
    args.streams = [int(s) for s in str(args.streams).split(",")]
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"bench: {tool} not found (scripts/bench.sh installs it)", file=sys.stderr)
            return 2
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(args))
    return int(uvloop.run(run(args)))


if __name__ == "__main__":
    sys.exit(main())
