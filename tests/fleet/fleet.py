"""A fleet behind vLLM's own router, unmodified: `vllm-router` (the PyPI wheel, Rust) in front of several
lifeguard + engine pairs, under steady open-loop load, while one engine is put to sleep and woken in cycles
through its own lifeguard. Run once with `--health-check-endpoint /health` (vLLM's, what routers use today)
and once with `/lifeguard/serving`, it counts the requests the sleeping engine's lifeguard held, and when.

Used by tests/fleet/test_vllm_router.py (simulators, `make test-fleet`) and tests/vllm/test_vllm_fleet.py (a
real vLLM-for-CPU as the engine that sleeps, `make test-vllm`). Everything listens on 127.0.0.1; every wait has
a deadline; every process started here is stopped here.

What is measured, per sleep of the engine (time 0 = the harness sends `/sleep` to its lifeguard):
* `holds`: requests the sleeping engine's lifeguard held in the cycle (its `lifeguard_hold_duration_seconds`
  count, which counts each held request once, when it leaves the hold);
* `held_after_interval`: of those, the ones that arrived later than one health interval plus `grace_s` after
  the sleep began: `held_requests` in its `/lifeguard/state` just before the wake, less the same read at that
  moment (nothing leaves the hold before the wake);
* `last_hold_s`: when the last held request arrived, from `held_requests` read every `POLL_S`;
and over the whole run, from the client: requests sent, answered 200, answered otherwise, lost (no answer),
and the latency percentiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.lifeguard_testing import start_process_group, stop_process_group

POLL_S = 0.05
MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
ROUTER_VERSION = "0.1.17"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process in its own process group, its output in `workdir/<name>.log`."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self.popen = start_process_group(argv, self.log_path, env or {}, header=f"==== {' '.join(argv)}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        stop_process_group(self.popen, timeout)


@dataclass
class Pair:
    """One engine (a simulator started here, or a vLLM given by URL) and the lifeguard in front of it."""

    name: str
    upstream: str
    lifeguard: Proc
    port: int
    engine: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cycle:
    slept_s: float  # /sleep answered, after it was sent
    woke_s: float  # /wake_up answered, after it was sent
    holds: int
    held_at_interval: int
    held_before_wake: int
    last_hold_s: float | None

    @property
    def held_after_interval(self) -> int:
        return self.held_before_wake - self.held_at_interval


@dataclass
class Run:
    endpoint: str
    interval_s: int
    grace_s: float
    rate: float
    sent: int = 0
    ok: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    answered: list[tuple[float, float]] = field(default_factory=list)  # (sent at, latency) of every answer
    cycles: list[Cycle] = field(default_factory=list)
    # From one interval (+grace) after each /sleep was sent to the wake's answer: what a router that follows the
    # health check has had time to learn.
    late_windows: list[tuple[float, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        late = sorted(latency for sent, latency in self.answered if any(a <= sent < b for a, b in self.late_windows))
        return {
            "endpoint": self.endpoint,
            "interval_s": self.interval_s,
            "grace_s": self.grace_s,
            "rate": self.rate,
            "cycles": len(self.cycles),
            "sent": self.sent,
            "ok": self.ok,
            "non_200": sum(self.statuses.values()),
            "statuses": self.statuses,
            "lost": len(self.lost),
            "holds": sum(c.holds for c in self.cycles),
            "held_after_interval": sum(c.held_after_interval for c in self.cycles),
            "last_hold_s": max((c.last_hold_s for c in self.cycles if c.last_hold_s is not None), default=None),
            "p50_ms": _ms(lat, 0.5),
            "p99_ms": _ms(lat, 0.99),
            "max_ms": _ms(lat, 1.0),
            "late_sent": len(late),
            "late_p99_ms": _ms(late, 0.99),
            "per_cycle": [asdict(c) | {"held_after_interval": c.held_after_interval} for c in self.cycles],
        }


def _ms(ordered: list[float], quantile: float) -> float | None:
    """The `quantile` of sorted seconds, in milliseconds (nearest rank)."""
    if not ordered:
        return None
    return round(1000 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))], 1)


def router_argv(exe: str, port: int, workers: list[str], endpoint: str, interval_s: int, metrics: int) -> list[str]:
    """vllm-router as a fleet would run it: round robin over the lifeguards, every other setting at its default
    except the health check (the endpoint, a short interval, one check to go out and one to come back)."""
    return [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        "round_robin",
        "--health-check-endpoint",
        endpoint,
        "--health-check-interval-secs",
        str(interval_s),
        "--health-failure-threshold",
        "1",
        "--health-success-threshold",
        "1",
        "--health-check-timeout-secs",
        "1",
        "--worker-startup-check-interval",
        "1",
        "--prometheus-port",
        str(metrics),
        "--log-level",
        "warning",
    ]


class Fleet:
    """The pairs (started once) and a router per run."""

    def __init__(self, workdir: Path, router_exe: str) -> None:
        self.workdir = workdir
        self.router_exe = router_exe
        self.pairs: list[Pair] = []
        self._procs: list[Proc] = []

    def start_pair(self, name: str, upstream: str | None = None, lifeguard_env: dict[str, str] | None = None) -> Pair:
        """A lifeguard in front of `upstream`, or of a simulator started here (serving `MODEL`)."""
        engine = None
        probe = "none"
        if upstream is None:
            sim_port = free_port()
            gpu_file = self.workdir / f"{name}-gpu.json"
            argv = [sys.executable, "-m", "proxy", "sim", "--port", str(sim_port), "--model", MODEL]
            engine = self._start(f"{name}-sim", [*argv, "--gpu-file", str(gpu_file), "--log-level", "warning"])
            upstream = f"http://127.0.0.1:{sim_port}"
            probe = f"file:{gpu_file}"
        port = free_port()
        argv = [sys.executable, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(port)]
        lifeguard = self._start(f"{name}-lifeguard", [*argv, "--gpu-probe", probe, "--log-level", "warning"],
                                env=lifeguard_env)  # fmt: skip
        pair = Pair(name, upstream, lifeguard, port, engine)
        self.pairs.append(pair)
        return pair

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, self.workdir, env)
        self._procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()})\n{p.tail()}" for p in self._procs)

    async def wait_running(self, session: aiohttp.ClientSession, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pair in self.pairs:
            while True:
                for proc in (pair.lifeguard, pair.engine):
                    if proc is not None and not proc.alive():
                        raise AssertionError(f"{proc.name} exited:\n{proc.tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    state = await get_json(session, pair.url + "/lifeguard/state", timeout=2)
                    if state["state"] == "RUNNING" and not state["lifecycle_busy"]:
                        break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{pair.name} not RUNNING within {timeout} s:\n{self.logs()}")
                await asyncio.sleep(0.1)

    @contextlib.asynccontextmanager
    async def router(self, session: aiohttp.ClientSession, endpoint: str, interval_s: int) -> Any:
        """vllm-router in front of every pair, ready (every worker healthy) when entered; stopped after."""
        port, metrics_port = free_port(), free_port()
        argv = router_argv(self.router_exe, port, [p.url for p in self.pairs], endpoint, interval_s, metrics_port)
        name = "router-" + endpoint.strip("/").replace("/", "-")
        proc = Proc(name, argv, self.workdir, env={"TOKIO_WORKER_THREADS": "2"})
        try:
            deadline = time.monotonic() + 60
            while True:
                if not proc.alive():
                    raise AssertionError(f"vllm-router exited:\n{proc.tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    healthy = worker_health(await get_text(session, f"http://127.0.0.1:{metrics_port}/metrics"))
                    if len(healthy) == len(self.pairs) and all(healthy.values()):
                        break
                if time.monotonic() > deadline:
                    raise AssertionError(f"vllm-router not ready within 60 s:\n{proc.tail()}")
                await asyncio.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.stop()


async def get_json(session: aiohttp.ClientSession, url: str, timeout: float = 5) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        return await resp.json(content_type=None)


async def get_text(session: aiohttp.ClientSession, url: str, timeout: float = 5) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        return await resp.text()


def worker_health(metrics: str) -> dict[str, bool]:
    """vllm-router's own view of its workers (`vllm_router_worker_health{worker=...} 0|1`)."""
    found = re.findall(r'^vllm_router_worker_health\{worker="([^"]+)"\} (\S+)$', metrics, re.MULTILINE)
    return {worker: float(value) == 1 for worker, value in found}


def hold_count(metrics: str) -> int:
    """Held requests that left the hold, every way (`lifeguard_hold_duration_seconds_count`, every outcome)."""
    found = re.findall(r"^lifeguard_hold_duration_seconds_count\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    return int(sum(float(value) for value in found))


async def held_now(session: aiohttp.ClientSession, pair: Pair) -> int:
    return int((await get_json(session, pair.url + "/lifeguard/state"))["held_requests"])


async def lifecycle(session: aiohttp.ClientSession, pair: Pair, path: str, timeout: float) -> float:
    started = time.monotonic()
    async with session.post(pair.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        body = await resp.text()
        assert resp.status == 200, f"{pair.name} {path}: {resp.status} {body}"
    return time.monotonic() - started


class Load:
    """Open-loop load: a request every 1/rate s, whatever the answers do (a held request does not slow the
    arrivals, as it would with a fixed number of clients); each request ends within `timeout_s`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, rate: float, timeout_s: float, run: Run) -> None:
        self._session = session
        self._url = url + "/v1/completions"
        self._rate = rate
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._run = run
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pacer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._pacer = asyncio.ensure_future(self._pace())

    async def _pace(self) -> None:
        started = time.monotonic()
        count = 0
        while not self._stop.is_set():
            task = asyncio.ensure_future(self._one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            count += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, started + count / self._rate - time.monotonic()))

    async def _one(self) -> None:
        run = self._run
        run.sent += 1
        started = time.monotonic()
        try:
            async with self._session.post(self._url, json=BODY, timeout=self._timeout) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            run.lost.append(repr(exc))
            return
        run.latencies.append(time.monotonic() - started)
        run.answered.append((started, run.latencies[-1]))
        if status == 200:
            run.ok += 1
        else:
            run.statuses[str(status)] = run.statuses.get(str(status), 0) + 1

    async def stop(self) -> None:
        """Stop sending, then wait for every answer (each is bounded by the client timeout)."""
        self._stop.set()
        if self._pacer is not None:
            await self._pacer
        if self._tasks:
            await asyncio.wait(set(self._tasks))


async def sleep_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


async def run_cycles(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    *,
    endpoint: str,
    interval_s: int = 1,
    grace_s: float = 0.5,
    cycles: int = 3,
    asleep_s: float = 3.0,
    awake_s: float = 3.0,
    rate: float = 40.0,
    call_timeout_s: float = 60.0,
) -> Run:
    """One run: the router with `endpoint`, load at `rate`, and `cycles` sleeps of the first pair's engine."""
    sleeper = fleet.pairs[0]
    run = Run(endpoint, interval_s, grace_s, rate)
    async with fleet.router(session, endpoint, interval_s) as router:
        load = Load(session, router, rate, timeout_s=asleep_s + call_timeout_s + 30, run=run)
        load.start()
        try:
            await asyncio.sleep(awake_s)  # steady state first: every engine serving
            for _ in range(cycles):
                t0 = time.monotonic()
                run.cycles.append(await _one_cycle(session, sleeper, interval_s, grace_s, asleep_s, call_timeout_s))
                run.late_windows.append((t0 + interval_s + grace_s, time.monotonic()))
                await asyncio.sleep(awake_s)
        finally:
            await load.stop()
    return run


async def _one_cycle(
    session: aiohttp.ClientSession, sleeper: Pair, interval_s: int, grace_s: float, asleep_s: float, timeout_s: float
) -> Cycle:
    before = hold_count(await get_text(session, sleeper.url + "/lifeguard/metrics"))
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    poller = asyncio.ensure_future(_poll_held(session, sleeper, samples))
    try:
        slept_s = await lifecycle(session, sleeper, "/sleep?level=1", timeout_s)
        await sleep_until(t0 + interval_s + grace_s)
        held_at_interval = await held_now(session, sleeper)
        await sleep_until(t0 + max(asleep_s, interval_s + grace_s))
        held_before_wake = await held_now(session, sleeper)
        woke_s = await lifecycle(session, sleeper, "/wake_up", timeout_s)
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    holds = hold_count(await get_text(session, sleeper.url + "/lifeguard/metrics")) - before
    rises = [t - t0 for (t, held), (_, previous) in zip(samples[1:], samples, strict=False) if held > previous]
    if samples and samples[0][1] > 0:
        rises.insert(0, samples[0][0] - t0)
    return Cycle(round(slept_s, 3), round(woke_s, 3), holds, held_at_interval, held_before_wake,
                 round(max(rises), 3) if rises else None)  # fmt: skip


async def _poll_held(session: aiohttp.ClientSession, pair: Pair, samples: list[tuple[float, int]]) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            samples.append((time.monotonic(), await held_now(session, pair)))
        await asyncio.sleep(POLL_S)


def table(runs: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table, one row per run."""
    rows = [
        "| health endpoint | sent | 200 | non-200 | lost | held by the sleeping engine | held after one interval "
        "(+grace) | last hold after /sleep | p50 ms | p99 ms | p99 ms of requests sent after one interval (+grace) "
        "until the wake |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        last = f"{r['last_hold_s']:.2f} s" if r["last_hold_s"] is not None else "none"
        rows.append(
            f"| `{r['endpoint']}` | {r['sent']} | {r['ok']} | {r['non_200']} | {r['lost']} | {r['holds']} | "
            f"{r['held_after_interval']} ({r['interval_s']} s + {r['grace_s']} s) | {last} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['late_p99_ms']} ({r['late_sent']} requests) |"
        )
    return "\n".join(rows)


def assert_serving_takes_the_sleeper_out(baseline: dict[str, Any], serving: dict[str, Any], interval_s: float) -> None:
    """The two runs' verdict. Both answered everything (a lifeguard holds, never drops). Checked on /health
    (`baseline`), the sleeping engine keeps its share, held until the wake; on /lifeguard/serving (`serving`) it is
    out at the router's next check, nothing is held after it, and requests sent once the router could know are
    answered without waiting for the wake."""
    assert baseline["held_after_interval"] > 0, baseline
    for run in (baseline, serving):
        assert run["lost"] == 0 and run["non_200"] == 0 and run["ok"] == run["sent"], run
    assert serving["held_after_interval"] == 0, serving
    assert serving["last_hold_s"] is None or serving["last_hold_s"] <= interval_s + serving["grace_s"], serving
    assert serving["late_p99_ms"] < baseline["late_p99_ms"], (serving, baseline)


def write_report(runs: list[dict[str, Any]], title: str) -> None:
    """Print the table; with LIFEGUARD_FLEET_REPORT set, also append the runs there as one JSON line."""
    print(f"\n{title}\n{table(runs)}\n", file=sys.stderr)
    path = os.environ.get("LIFEGUARD_FLEET_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as report:
            report.write(json.dumps({"title": title, "runs": runs}) + "\n")


def main(argv: list[str]) -> int:
    """`python -m tests.fleet.fleet REPORT`: the tables of the runs in a LIFEGUARD_FLEET_REPORT file."""
    for line in Path(argv[0]).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            print(f"{entry['title']}\n{table(entry['runs'])}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
