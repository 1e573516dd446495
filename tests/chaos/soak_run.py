"""The soak: the proxy in front of the simulator, under steady mixed load and a trainer's loop, for as long as asked.

    python -m tests.chaos.soak_run                    # make soak: 120 s (SOAK_S), as CI runs it
    python -m tests.chaos.soak_run --duration 3600    # make soak SOAK_S=3600: the hour of docs/reliability.md

The chaos run's processes and pieces (tests/chaos/): the simulator with its crash-proof journal
(sim_process.py, under SimSupervisor), `vllm-lifeguard serve` as its own process (ProxySupervisor, with a state
file, the product's defaults otherwise), the chaos clients (streamed and plain, completions and chat, some
leaving early), and the chaos run's judges. No fault is armed and the proxy is never killed: this is the long
run of a healthy stack, where a leak or a slow drift would show. One trainer runs a loop of the cycles an RL
trainer runs, in turn: a level-1 sleep and wake; a level-2 sleep, a wake (whole, or the weights first and the
KV cache after the reload, as SkyRL and verl do) and a weight reload; a pause and a resume; a weight-update
session (start, one to three updates, finish with a version). The sleep and pause modes vary.

Judged on: nothing lost (every request ends with upstream's answer or a proxy error with a reason, none past
its deadline); every lifecycle call answered 200 and every 200 true (the simulator's journal: its state in the
call's window is what the 200 promised); the simulator's violations empty (a request in transit when a pause
began aside, as the chaos run excuses it); the proxy's RSS and open descriptors flat: a least-squares slope over
the samples after the warm-up (tests/chaos/soak_checks.py), in MiB and descriptors per hour, under a bound;
nothing held or in flight at the end; a clean SIGTERM. Prints the figures; exits 1 if any judge says no.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.chaos.chaos_actors import SimSupervisor, Tally, _sleep_unless, client, lifecycle_call, proxy_state
from tests.chaos.chaos_checks import BAD_INFERENCE, Call, known_violation, read_journal, untruthful
from tests.chaos.chaos_proxy import ProxySupervisor
from tests.chaos.chaos_run import fetch_text, free_port, metric_sum, proxy_command, run_in_workdir, wait_until
from tests.chaos.soak_checks import MIB, Resources, after_warmup, fd_growth, flat, read_resources, rss_growth

# A healthy stack: a request waits at most for one cycle of the trainer's (a few seconds); past this it hung.
INFERENCE_DEADLINE_S = 30.0
LIFECYCLE_DEADLINE_S = 60.0
# The bounds of "flat", per hour over the samples after the warm-up. A leak of 64 bytes per request at the soak's
# rate (~150 requests/s on two cores) is ~33 MiB/h; a healthy two-minute run fits +7 MiB/h (its allocator still
# settling). The open descriptors move with the connections open at the moment (26-33 with eight clients, in
# swings of seconds): a healthy two-minute run fits within about +-30 fds/h, and a descriptor lost per trainer
# cycle, per request or per client gone is thousands an hour.
RSS_BOUND_MIB_PER_H = 32.0
FD_BOUND_PER_H = 120.0


class TrainerLoop:
    """One trainer's lifecycle calls through the proxy, a cycle at a time; each call recorded in the tally."""

    def __init__(self, session: aiohttp.ClientSession, base: str, tally: Tally, rng: random.Random) -> None:
        self._session, self._base, self._tally, self._rng = session, base, tally, rng
        self.cycles: Counter[str] = Counter()
        self._version = 0

    async def _call(self, op: str, query: list[tuple[str, str]] | None = None, body: Any = None) -> Call:
        return await lifecycle_call(self._session, self._base, op, query or [], body, self._tally,
                                    LIFECYCLE_DEADLINE_S)  # fmt: skip

    async def _rest(self) -> None:
        """Time asleep or paused, while the clients' requests are held."""
        await asyncio.sleep(self._rng.uniform(0.05, 0.5))

    def _mode(self) -> str:
        return self._rng.choice(["abort", "wait", "keep"])

    async def level_1(self) -> None:
        await self._call("sleep", [("level", "1"), ("mode", self._mode())])
        await self._rest()
        await self._call("wake_up")

    async def level_2(self) -> None:
        await self._call("sleep", [("level", "2"), ("mode", self._mode())])
        await self._rest()
        reload = {"method": "reload_weights"}
        if self._rng.random() < 0.5:  # SkyRL's and verl's order: the weights, their reload, then the KV cache
            await self._call("wake_up", [("tags", "weights")])
            await self._call("collective_rpc", body=reload)
            await self._call("wake_up", [("tags", "kv_cache")])
        else:
            await self._call("wake_up")
            await self._call("collective_rpc", body=reload)

    async def pause(self) -> None:
        await self._call("pause", [("mode", self._mode())])
        await self._rest()
        await self._call("resume")

    async def session(self) -> None:
        await self._call("start_weight_update")
        for _ in range(self._rng.randint(1, 3)):
            update = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
            await self._call("update_weights", body=update)
        self._version += 1
        await self._call("finish_weight_update", body={"weight_version": f"soak-{self._version}"})

    async def run(self, stop: asyncio.Event) -> None:
        """The cycles in turn, a little serving between them; a cycle begun is finished, so the engine ends awake."""
        cycles: list[Callable[[], Awaitable[None]]] = [self.level_1, self.level_2, self.pause, self.session]
        turn = 0
        while not stop.is_set():
            cycle = cycles[turn % len(cycles)]
            turn += 1
            await cycle()
            self.cycles[cycle.__name__] += 1
            await _sleep_unless(stop, self._rng.uniform(0.2, 1.0))


async def sample_resources(pid: int, every_s: float, samples: list[Resources], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(read_resources(pid, time.monotonic()))
        await _sleep_unless(stop, every_s)


async def run(args: argparse.Namespace, workdir: Path) -> int:
    sim = SimSupervisor(free_port(), workdir, args.seed)
    base = f"http://127.0.0.1:{free_port()}"
    cmd = [*proxy_command(), "serve", "--port", base.rsplit(":", 1)[1], "--upstream", sim.url,
           "--gpu-probe", f"file:{sim.gpu_file}"]  # fmt: skip
    env = {**os.environ, "LIFEGUARD_STATE_FILE": str(workdir / "proxy-state.json"),
           "LIFEGUARD_LOG_LEVEL": os.environ.get("SOAK_PROXY_LOG_LEVEL", "warning")}  # fmt: skip
    proxy = ProxySupervisor(cmd, env, workdir / "proxy.log", base)
    tally = Tally()
    samples: list[Resources] = []
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))
    trainer = TrainerLoop(session, base, tally, random.Random(args.seed * 2000))
    leftover: dict[str, Any] | None = None
    metrics_text = ""
    try:
        sim.start()
        await sim.wait_healthy(session)
        proxy.start()

        async def running() -> bool:
            state = await proxy_state(session, base)
            return state is not None and state["state"] == "RUNNING"

        await wait_until("proxy RUNNING", running, 30)
        assert proxy.proc is not None
        print(f"soak: proxy {base} (pid {proxy.proc.pid}) -> sim {sim.url}; {args.clients} clients, one trainer, "
              f"{args.duration:g} s, seed {args.seed}; workdir {workdir}", flush=True)  # fmt: skip
        stop_sampling, stop_trainer, stop_load = asyncio.Event(), asyncio.Event(), asyncio.Event()
        sampler = asyncio.create_task(sample_resources(proxy.proc.pid, args.sample_every, samples, stop_sampling))
        clients = [asyncio.create_task(client(session, base, args.seed * 1000 + i, tally, stop_load,
                                              INFERENCE_DEADLINE_S)) for i in range(args.clients)]  # fmt: skip
        looping = asyncio.create_task(trainer.run(stop_trainer))
        started = time.monotonic()
        progress_every = max(10.0, args.duration / 20)
        next_progress = started + progress_every
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(0.5)
            if looping.done():
                break  # the loop raised: the end below reports it
            if time.monotonic() >= next_progress and samples:
                next_progress += progress_every
                last = samples[-1]
                print(f"  t={time.monotonic() - started:5.0f}s requests={tally.sent} "
                      f"cycles={sum(trainer.cycles.values())} rss={last.rss_bytes / MIB:.1f} MiB "
                      f"fds={last.fds}", flush=True)  # fmt: skip
        seconds = time.monotonic() - started
        stop_trainer.set()
        await asyncio.wait_for(looping, 4 * LIFECYCLE_DEADLINE_S)
        stop_load.set()
        await asyncio.wait_for(asyncio.gather(*clients), INFERENCE_DEADLINE_S + 10)

        async def drained() -> dict[str, Any] | None:
            state = await proxy_state(session, base)
            return state if state and state["held_requests"] == 0 and state["inflight_requests"] == 0 else None

        try:
            leftover = await wait_until("nothing held or in flight", drained, 10)
        except RuntimeError:
            leftover = await proxy_state(session, base)
        stop_sampling.set()
        await sampler
        metrics_text = await fetch_text(session, base + "/lifeguard/metrics")
    finally:
        proxy_rc = proxy.stop()
        sim.stop()
        await session.close()
    return report(args, tally, trainer, read_journal(sim.journal), samples, seconds, leftover, proxy_rc,
                  metrics_text, workdir)  # fmt: skip


def report(args: argparse.Namespace, tally: Tally, trainer: TrainerLoop, journal: Any, samples: list[Resources],
           seconds: float, leftover: dict[str, Any] | None, proxy_rc: int | None, metrics_text: str,
           workdir: Path) -> int:  # fmt: skip
    inference = [c for c in tally.calls if c.kind == "inference"]
    lifecycle = [c for c in tally.calls if c.kind != "inference"]
    outcomes = Counter(c.outcome for c in inference)
    by_op = Counter(f"{c.kind}:{c.status}" for c in lifecycle)
    reasons = Counter(f"{c.status} {c.reason}" for c in tally.calls if c.reason)
    latencies = sorted(c.t_end - c.t_send for c in inference if c.outcome == "ok")
    steady = after_warmup(samples, args.warmup)
    rss, fds = rss_growth(steady), fd_growth(steady)
    checked, lies = untruthful(lifecycle, journal.timeline)
    violations = [v for v in journal.violations if not known_violation(v, journal.pausing)]
    excused = len(journal.violations) - len(violations)

    def p(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    def span(values: list[float]) -> str:
        return f"{values[0]:.1f} -> {values[-1]:.1f} (min {min(values):.1f}, max {max(values):.1f})" if values else "-"

    print("\n=== soak figures ===")
    print(f"soak                   {seconds:.0f} s, seed {args.seed}, {args.clients} clients, one trainer")
    print(f"requests sent/ended    {tally.sent} / {tally.ended}  ({tally.sent / max(seconds, 1):.1f}/s; the proxy "
          f"counted {metric_sum(metrics_text, 'lifeguard_inference_requests_total'):.0f})")  # fmt: skip
    print(f"  outcomes             {dict(sorted(outcomes.items()))}")
    print(f"  ok latency           p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, max {p(1.0):.0f} ms")
    print(f"trainer cycles         {dict(sorted(trainer.cycles.items()))}")
    print(f"lifecycle calls        {len(lifecycle)}: {dict(sorted(by_op.items()))}")
    print(f"proxy errors by reason {dict(sorted(reasons.items()))}")
    print(f"engine                 {len(journal.deaths)} deaths; {len(journal.violations)} violations "
          f"({excused} in transit at a pause, excused)")  # fmt: skip
    print(f"proxy RSS (MiB)        {span([s.rss_bytes / MIB for s in steady])} over {rss.samples} samples in "
          f"{rss.span_s:.0f} s after a {args.warmup:g} s warm-up; fit {rss.per_hour:+.2f} MiB/h "
          f"(± {rss.stderr_per_hour:.2f})")  # fmt: skip
    print(f"proxy open fds         {span([float(s.fds) for s in steady])}; fit {fds.per_hour:+.2f} fds/h "
          f"(± {fds.stderr_per_hour:.2f})")  # fmt: skip

    broken: list[str] = []

    def check(ok: bool, text: str, detail: list[str] | None = None) -> None:
        print(f"  [{'ok' if ok else 'BROKEN'}] {text}")
        if not ok:
            broken.append(text)
            for line in (detail or [])[:10]:
                print(f"           {line}")

    def show(calls: list[Call]) -> list[str]:
        return [f"{c.kind} {c.query} -> {c.status} {c.outcome} {c.reason or ''} {c.detail}" for c in calls]

    lost = [c for c in inference if c.outcome in BAD_INFERENCE or c.outcome == "pending"]
    refused = [c for c in lifecycle if c.status != 200]
    print("\n=== invariants ===")
    check(tally.sent == tally.ended, f"sent == ended ({tally.sent} == {tally.ended}); 0 requests lost")
    check(not lost, f"every request ended as upstream's answer or a proxy error with a reason ({len(lost)} did not; "
          f"deadline {INFERENCE_DEADLINE_S:g} s)", show(lost))  # fmt: skip
    check(not [c for c in tally.calls if c.status == 500 and c.reason], "0 proxy-made 500s")
    check(bool(lifecycle) and not refused, f"every lifecycle call answered 200 ({len(refused)} of {len(lifecycle)} "
          "not): a sound loop on a healthy engine has nothing to refuse", show(refused))  # fmt: skip
    check(checked > 0 and not lies, f"every lifecycle 200 true ({len(lies)} of {checked} not, against "
          f"{len(journal.timeline)} engine states)", [f"{c.kind} {c.query}: {c.detail}" for c, _ in lies])  # fmt: skip
    check(not violations and not journal.deaths, f"the simulator saw no violation and no death ({len(violations)}, "
          f"{len(journal.deaths)})", [json.dumps(v) for v in violations])  # fmt: skip
    check(all(trainer.cycles[name] for name in ("level_1", "level_2", "pause", "session")),
          "every kind of trainer cycle ran")  # fmt: skip
    check(flat(rss, args.rss_bound), f"proxy RSS flat: {rss.per_hour:+.2f} MiB/h <= {args.rss_bound:g} MiB/h")
    check(flat(fds, args.fd_bound), f"proxy open fds flat: {fds.per_hour:+.2f} fds/h <= {args.fd_bound:g} fds/h")
    check(leftover is not None and leftover["state"] == "RUNNING" and leftover["held_requests"] == 0
          and leftover["inflight_requests"] == 0, "RUNNING, nothing held or in flight at the end")  # fmt: skip
    check(proxy_rc == 0, f"SIGTERM: the proxy exited 0 (exit status {proxy_rc})")

    summary = {
        "seconds": round(seconds), "seed": args.seed, "clients": args.clients, "requests": tally.sent,
        "ended": tally.ended, "outcomes": dict(outcomes), "lifecycle_calls": len(lifecycle),
        "cycles": dict(trainer.cycles), "reasons": dict(reasons), "truth_checked": checked,
        "latency_ms": {"p50": round(p(0.5)), "p99": round(p(0.99)), "max": round(p(1.0))},
        "rss_mib_per_h": round(rss.per_hour, 3), "rss_stderr_mib_per_h": round(rss.stderr_per_hour, 3),
        "rss_mib": [round(steady[0].rss_bytes / MIB, 1), round(steady[-1].rss_bytes / MIB, 1)] if steady else None,
        "fds_per_h": round(fds.per_hour, 3), "fds_stderr_per_h": round(fds.stderr_per_hour, 3),
        "fds": [steady[0].fds, steady[-1].fds] if steady else None, "samples": rss.samples, "broken": broken,
    }  # fmt: skip
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    (workdir / "resources.jsonl").write_text("".join(json.dumps(vars(s)) + "\n" for s in samples))
    print(f"\nsoak: {'PASS' if not broken else 'FAIL: ' + '; '.join(broken)} (seed {args.seed}; workdir {workdir})")
    return 0 if not broken else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=float(os.environ.get("SOAK_S", 120)))
    parser.add_argument("--clients", type=int, default=int(os.environ.get("SOAK_CLIENTS", 8)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED", random.randrange(1, 10_000))))
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds left out of the fits (default: a fifth, at most 120)"
    )
    parser.add_argument(
        "--sample-every", type=float, default=None, help="seconds between two looks (default: 0.25, 1 past 10 min)"
    )
    parser.add_argument("--rss-bound", type=float, default=RSS_BOUND_MIB_PER_H, help="MiB per hour")
    parser.add_argument("--fd-bound", type=float, default=FD_BOUND_PER_H, help="descriptors per hour")
    parser.add_argument("--workdir", default=os.environ.get("SOAK_WORKDIR"))
    parser.add_argument("--keep", action="store_true", help="keep the workdir even when the soak passes")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(args.duration / 5, 120.0)
    if args.sample_every is None:
        # The open descriptors move with the connections open at the moment (8 clients: 26-33); many looks keep
        # the noise of a short run's fit (its standard error) well under the bound.
        args.sample_every = 0.25 if args.duration <= 600 else 1.0
    return run_in_workdir(args, "lifeguard-soak-", run)


if __name__ == "__main__":
    sys.exit(main())
