"""The chaos run: the proxy in front of a crashing, lying, hanging simulator, under load, for a bounded time.

    python tests/chaos/chaos_run.py --duration 600          # the full run
    python tests/chaos/chaos_run.py --quick                 # the bounded CI run (~90 s)

Processes: the simulator (tests/chaos/sim_process.py: `vllm-lifeguard sim` plus a crash-proof journal)
under a restarter, and `vllm-lifeguard serve --upstream ... --gpu-probe file:GPUFILE`, which is killed -9
and started again on the same port at random moments (tests/chaos/chaos_proxy.py). Actors: clients
(streaming and not, some leaving early), trainers (random lifecycle sequences, repeats, out-of-order
calls, weight-update sessions), a fault injector (every fault kind in turn) and a healer (restarts an
engine that stays FAILED). Then a quiet settle, a recovery to RUNNING, and the invariants
(docs/reliability.md says what each means). Prints the figures; exits 1 if any invariant broke.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from chaos_actors import (
    FAULT_OPS,
    SimSupervisor,
    Tally,
    client,
    fault_injector,
    healer,
    lifecycle_call,
    proxy_state,
    sim_state,
    trainer,
)
from chaos_checks import (
    BAD_INFERENCE,
    KNOWN_BUGS,
    Call,
    cut_by_restart,
    engine_matches,
    known_violation,
    read_journal,
    session_cut,
    untruthful,
)
from chaos_proxy import ProxySupervisor, proxy_killer

PROXY_ENV = {
    "LIFEGUARD_HOLD_TIMEOUT_S": "5",
    "LIFEGUARD_RECONCILE_INTERVAL_S": "0.3",
    "LIFEGUARD_VERIFY_TIMEOUT_S": "1.5",
    "LIFEGUARD_VERIFY_POLL_INTERVAL_S": "0.02",
    "LIFEGUARD_LIFECYCLE_CALL_TIMEOUT_S": "8",
    "LIFEGUARD_LIFECYCLE_QUEUE_TIMEOUT_S": "20",
    "LIFEGUARD_CONTROL_CALL_TIMEOUT_S": "2",
    "LIFEGUARD_CANARY_TIMEOUT_S": "3",
    "LIFEGUARD_MAX_HELD_REQUESTS": "400",
    "LIFEGUARD_SHUTDOWN_GRACE_S": "3",
    "LIFEGUARD_LOG_LEVEL": os.environ.get("CHAOS_PROXY_LOG_LEVEL", "warning"),  # info: every lifecycle op
}
# A request's deadline: the hold deadline, plus a hang the operator ends by a restart, plus a generation
# frozen by a `keep` pause until a trainer lifts it. Past this, it counts as a hang.
INFERENCE_DEADLINE_S = 45.0
# Queue deadline (20 s) + call deadline (8 s) + verification + slack.
LIFECYCLE_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def proxy_command() -> list[str]:
    script = Path(sys.executable).with_name("vllm-lifeguard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "proxy"]


async def wait_until(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} not reached within {timeout} s")


async def run(args: argparse.Namespace, workdir: Path) -> int:
    sim = SimSupervisor(free_port(), workdir, args.seed)
    proxy_port = free_port()
    base = f"http://127.0.0.1:{proxy_port}"
    tally = Tally()
    proxy: ProxySupervisor | None = None
    stop_restarter = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
    restarter_task: asyncio.Task[None] | None = None
    try:
        sim.start()
        await sim.wait_healthy(session)
        restarter_task = asyncio.create_task(sim.restarter(stop_restarter), name="restarter")
        cmd = [*proxy_command(), "serve", "--upstream", sim.url, "--port", str(proxy_port),
               "--gpu-probe", f"file:{sim.gpu_file}"]  # fmt: skip
        env = {**os.environ, **PROXY_ENV, "LIFEGUARD_STATE_FILE": str(workdir / "proxy-state.json")}
        proxy = ProxySupervisor(cmd, env, workdir / "proxy.log", base)
        proxy.start()

        async def running() -> bool:
            state = await proxy_state(session, base)
            return state is not None and state["state"] == "RUNNING"

        await wait_until("proxy RUNNING", running, 30)
        started = time.monotonic()
        print(f"chaos: proxy {base} -> sim {sim.url}; {args.clients} clients, {args.trainers} trainers, "
              f"{args.duration:g} s; workdir {workdir}", flush=True)  # fmt: skip

        stop_load = asyncio.Event()
        stop_chaos = asyncio.Event()
        clients = [
            asyncio.create_task(client(session, base, args.seed * 1000 + i, tally, stop_load, INFERENCE_DEADLINE_S))
            for i in range(args.clients)
        ]
        chaos = [
            asyncio.create_task(trainer(session, base, args.seed * 2000 + i, tally, stop_chaos, LIFECYCLE_DEADLINE_S))
            for i in range(args.trainers)
        ]
        chaos.append(asyncio.create_task(fault_injector(session, sim, args.seed, tally, stop_chaos)))
        chaos.append(asyncio.create_task(healer(session, base, sim, tally, stop_chaos)))
        if args.proxy_restarts:
            every = (6.0, 15.0) if args.quick else (8.0, 20.0)

            def lifecycle_in_flight() -> bool:
                return any(c.kind != "inference" and c.outcome == "pending" for c in tally.calls[-300:])

            chaos.append(asyncio.create_task(
                proxy_killer(session, proxy, args.seed, every, lifecycle_in_flight, stop_chaos)))  # fmt: skip
        progress_every = max(10.0, args.duration / 10)
        next_progress = started + progress_every
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(0.5)
            if time.monotonic() >= next_progress:
                next_progress += progress_every
                ops = sum(1 for c in tally.calls if c.kind != "inference")
                print(f"  t={time.monotonic() - started:5.0f}s requests={tally.sent} lifecycle={ops} "
                      f"restarts={sim.restarts}", flush=True)  # fmt: skip
        chaos_seconds = time.monotonic() - started

        # 1. Quiet: no lifecycle call, no fault; clients go on. The proxy must come to agree with the engine.
        stop_chaos.set()
        await asyncio.wait_for(asyncio.gather(*chaos), LIFECYCLE_DEADLINE_S + 10)
        settle = await settle_and_compare(session, base, sim, session_cut(tally.calls, proxy.downtimes))

        # 2. Recovery through the proxy's own routes, then traffic must flow again.
        recovered = await recover(session, base, sim, tally)
        stop_load.set()
        await asyncio.wait_for(asyncio.gather(*clients), INFERENCE_DEADLINE_S + 10)
        final_ok = 0
        for _ in range(10):
            try:
                body = {"model": "tiny", "prompt": "ok", "max_tokens": 2}
                async with session.post(
                    base + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=15)
                ) as resp:
                    final_ok += resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                pass

        async def drained() -> dict[str, Any] | None:
            state = await proxy_state(session, base)
            return state if state and state["held_requests"] == 0 and state["inflight_requests"] == 0 else None

        try:
            leftover: dict[str, Any] | None = await wait_until("nothing held or in flight", drained, 10)
        except RuntimeError:
            leftover = await proxy_state(session, base)
        metrics_text = await fetch_text(session, base + "/lifeguard/metrics")
    finally:
        stop_restarter.set()
        if restarter_task is not None:
            await restarter_task
        proxy_rc = proxy.stop() if proxy is not None else None
        sim.stop()
        await session.close()

    journal = read_journal(sim.journal)
    return report(args, tally, journal, sim, chaos_seconds, settle, recovered, final_ok, leftover, proxy_rc,
                  metrics_text, workdir, proxy.downtimes)  # fmt: skip


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def settle_and_compare(session: aiohttp.ClientSession, base: str, sim: SimSupervisor,
                             session_unknowable: bool) -> str | None:  # fmt: skip
    """Poll until the proxy's settled state equals the engine's twice in a row; the mismatch if it never does."""
    await asyncio.sleep(1.0)  # the run's own pacing: let the last reconcile rounds happen
    deadline = time.monotonic() + 20
    last = "never compared"
    agreed = 0
    while time.monotonic() < deadline:
        proxy, engine = await proxy_state(session, base), await sim_state(session, sim)
        if proxy is not None and engine is not None and not proxy["lifecycle_busy"]:
            problem = engine_matches(proxy, engine, session_unknowable=session_unknowable)
            if problem is None:
                agreed += 1
                if agreed >= 2:
                    return None
            else:
                agreed = 0
                last = problem
        await asyncio.sleep(0.2)
    return last


async def recover(session: aiohttp.ClientSession, base: str, sim: SimSupervisor, tally: Tally) -> bool:
    """Bring the engine back to RUNNING with fresh weights the way a trainer would, through the proxy."""
    for _ in range(30):
        state = await proxy_state(session, base)
        if state is None:
            await asyncio.sleep(0.2)
            continue
        name = state["state"]
        if name == "RUNNING" and not state["weights_stale"]:
            return True
        if name == "UPDATING_WEIGHTS":
            await lifecycle_call(session, base, "finish_weight_update", [], None, tally, LIFECYCLE_DEADLINE_S)
        elif name == "SLEEPING":
            await lifecycle_call(session, base, "wake_up", [], None, tally, LIFECYCLE_DEADLINE_S)
        elif name == "PAUSED":
            await lifecycle_call(session, base, "resume", [], None, tally, LIFECYCLE_DEADLINE_S)
        elif name == "RUNNING":
            body = {"method": "reload_weights"}
            await lifecycle_call(session, base, "collective_rpc", [], body, tally, LIFECYCLE_DEADLINE_S)
        elif name == "FAILED":
            sim.kill()
            await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(0.2)
    return False


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def report(
    args: argparse.Namespace,
    tally: Tally,
    journal: Any,
    sim: SimSupervisor,
    seconds: float,
    settle: str | None,
    recovered: bool,
    final_ok: int,
    leftover: dict[str, Any] | None,
    proxy_rc: int | None,
    metrics_text: str,
    workdir: Path,
    downtimes: list[tuple[float, float]],
) -> int:
    inference = [c for c in tally.calls if c.kind == "inference"]
    lifecycle = [c for c in tally.calls if c.kind != "inference"]
    outcomes = Counter(c.outcome for c in inference)
    reasons = Counter(f"{c.status} {c.reason}" for c in tally.calls if c.reason)
    by_op = Counter(f"{c.kind}:{c.outcome}" for c in lifecycle)
    proxy_500 = [c for c in tally.calls if c.status == 500 and c.reason]
    known: Counter[str] = Counter()
    proxy_bugs = [c for c in tally.calls if c.reason == "proxy_error"]
    cut = [c for c in tally.calls if cut_by_restart(c, downtimes)]
    bad_inference = [c for c in inference if (c.outcome in BAD_INFERENCE or c.outcome == "pending") and c not in cut]
    bad_lifecycle = [c for c in lifecycle if c.outcome not in ("ok", "noop", "proxy_error") and c not in cut]
    checked, lies = untruthful(lifecycle, journal.timeline)
    latencies = sorted(c.t_end - c.t_send for c in inference if c.outcome == "ok")

    def p(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    kinds = sorted(FAULT_OPS)
    not_fired = [k for k in kinds if journal.faults_fired.get(k, 0) == 0]
    counted = metric_sum(metrics_text, "lifeguard_inference_requests_total")

    print("\n=== chaos figures ===")
    print(f"chaos phase            {seconds:.0f} s, seed {args.seed}")
    print(f"requests sent/ended    {tally.sent} / {tally.ended}  (last proxy: {counted:.0f} reached a handler)")
    print(f"  outcomes             {dict(sorted(outcomes.items()))}")
    print(f"  ok latency           p50 {p(0.5) * 1000:.0f} ms, p99 {p(0.99) * 1000:.0f} ms, max "
          f"{(latencies[-1] if latencies else 0) * 1000:.0f} ms")  # fmt: skip
    print(f"lifecycle calls        {len(lifecycle)}  ({sum(c.outcome in ('ok', 'noop') for c in lifecycle)} got 200)")
    print(f"  by op:outcome        {dict(sorted(by_op.items()))}")
    print(f"proxy errors by reason {dict(sorted(reasons.items()))}")
    print(f"faults injected        {dict(sorted(tally.faults_injected.items()))}")
    print(f"faults fired           {dict(sorted(journal.faults_fired.items()))}")
    print(f"engine deaths/restarts {len(journal.deaths)} simulated deaths, {sim.restarts} restarts "
          f"(operator kills {dict(tally.kills)})")  # fmt: skip
    print(f"lifecycle 200s checked {checked} against {len(journal.timeline)} engine states")
    cut_kinds = Counter("inference" if c.kind == "inference" else "lifecycle" for c in cut)
    print(f"proxy restarts         {len(downtimes)} kill -9 + restart on the same port; calls cut (connection error): "
          f"{dict(cut_kinds)}")  # fmt: skip

    broken: list[str] = []

    def check(ok: bool, text: str, detail: list[str] | None = None) -> None:
        print(f"  [{'ok' if ok else 'BROKEN'}] {text}")
        if not ok:
            broken.append(text)
            for line in (detail or [])[:10]:
                print(f"           {line}")

    def show(calls: list[Call]) -> list[str]:
        return [f"{c.kind} {c.query} -> {c.status} {c.outcome} {c.reason or ''} {c.detail}" for c in calls]

    print("\n=== invariants ===")
    check(tally.sent == tally.ended, f"sent == ended ({tally.sent} == {tally.ended}); 0 requests lost")
    check(not bad_inference, f"every request ended as upstream's answer or a proxy error with a reason "
          f"({len(bad_inference)} did not)", show(bad_inference))  # fmt: skip
    check(not [c for c in inference if c.outcome == "hang"], f"0 hangs past the {INFERENCE_DEADLINE_S:g} s deadline")
    check(not proxy_500, f"0 proxy-made 500s ({len(proxy_500)})", show(proxy_500))
    check(not proxy_bugs, f"0 unexpected proxy errors (reason proxy_error: {len(proxy_bugs)})", show(proxy_bugs))
    check(not bad_lifecycle, f"every lifecycle call answered: 200, or a proxy error with a reason "
          f"({len(bad_lifecycle)} not)", show(bad_lifecycle))  # fmt: skip
    violations = []
    for v in journal.violations:
        bug = "" if args.strict else known_violation(v, journal.pausing)
        known[bug] += bool(bug)
        if not bug:
            violations.append(v)
    check(not violations, f"simulator violations empty ({len(violations)}; known core bugs aside)",
          [json.dumps(v) for v in violations])  # fmt: skip
    real_lies = [c for c, bug in lies if args.strict or not bug]
    known.update(bug for _, bug in lies if bug and not args.strict)
    check(not real_lies, f"every lifecycle 200 truthful ({len(real_lies)} of {checked} not; known core bugs aside)",
          [f"{c.kind}?{c.query} noop={c.noop} deferred={c.deferred}: {c.detail}" for c in real_lies])  # fmt: skip
    check(settle is None, f"proxy state == engine state after a quiet settle ({settle or 'agreed'})")
    check(recovered and final_ok == 10, f"recovered to RUNNING through the proxy; {final_ok}/10 requests 200 after")
    check(leftover is not None and leftover["held_requests"] == 0 and leftover["inflight_requests"] == 0,
          "nothing held or in flight at the end (no leaked admission tickets)")  # fmt: skip
    check(proxy_rc == 0, f"SIGTERM: the proxy exited 0 (exit status {proxy_rc})")
    check(not not_fired, f"every fault kind fired ({', '.join(not_fired) or 'all ' + str(len(kinds))})")
    for bug, count in sorted(known.items()):
        if count:
            print(f"  [known] {bug}: {count} occurrence(s), not counted; {KNOWN_BUGS[bug]}")
    if args.require_targets:
        check(
            len(inference) >= 10_000 and len(lifecycle) >= 1_000,
            f"targets: >= 10,000 requests ({len(inference)}) and >= 1,000 lifecycle calls ({len(lifecycle)})",
        )
    summary = {
        "seconds": round(seconds), "seed": args.seed, "requests": tally.sent, "ended": tally.ended,
        "outcomes": dict(outcomes), "lifecycle_calls": len(lifecycle), "by_op": dict(by_op),
        "reasons": dict(reasons), "faults_injected": dict(tally.faults_injected),
        "faults_fired": dict(journal.faults_fired), "restarts": sim.restarts, "truth_checked": checked,
        "violations": len(journal.violations), "known_bugs": dict(known), "broken": broken,
        "proxy_restarts": len(downtimes), "cut_by_proxy_restart": dict(cut_kinds),
    }  # fmt: skip
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nchaos: {'PASS' if not broken else 'FAIL: ' + '; '.join(broken)} (logs and summary in {workdir})")
    return 0 if not broken else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=float(os.environ.get("CHAOS_DURATION", 600)))
    parser.add_argument("--quick", action="store_true", default=os.environ.get("CHAOS_QUICK") == "1",
                        help="the bounded CI run: 75 s of chaos, no volume targets")  # fmt: skip
    parser.add_argument("--clients", type=int, default=int(os.environ.get("CHAOS_CLIENTS", 16)))
    parser.add_argument("--trainers", type=int, default=int(os.environ.get("CHAOS_TRAINERS", 3)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", random.randrange(1, 10_000))))
    parser.add_argument("--workdir", default=os.environ.get("CHAOS_WORKDIR"))
    parser.add_argument("--keep", action="store_true", help="keep the workdir even when the run passes")
    parser.add_argument("--no-proxy-restarts", dest="proxy_restarts", action="store_false",
                        help="do not kill -9 and restart the proxy during the chaos phase")  # fmt: skip
    parser.add_argument("--strict", action="store_true", default=os.environ.get("CHAOS_STRICT") == "1",
                        help="count the known core bugs (KNOWN_BUGS) as broken invariants too")  # fmt: skip
    args = parser.parse_args(argv)
    args.require_targets = not args.quick
    if args.quick and "--duration" not in (argv if argv is not None else sys.argv[1:]):
        args.duration = float(os.environ.get("CHAOS_DURATION", 75))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lifeguard-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rc = asyncio.run(run(args, workdir))
    if rc == 0 and not args.keep and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
