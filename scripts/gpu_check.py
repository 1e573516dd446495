"""The check of `scripts/gpu-check.sh`: lifecycle steps through the proxy in front of the simulator.

The simulator (`vllm-lifeguard sim --memory cuda`) holds its weights and KV pool as real torch
allocations on the GPU, so the proxy's `nvml` probe sees them move; without CUDA the script runs it with
`--memory simulated --gpu-file` and the proxy's `file:` probe instead. The steps: honest sleep and wake
at levels 1 and 2 (wake by tag, reload_weights between), a lying sleep and a lying wake (the
simulator's `lie-memory` fault, armed for one call: flags flip, memory does not move). For each it reads
what the proxy verified (`X-Lifeguard-Verified`, `/lifeguard/state`) and what the engine's device holds
(`/sim/state`), and writes the figures as JSON.

    python scripts/gpu_check.py check --proxy URL --engine URL --out FILE [--deadline-s S] [--extra JSON]
    python scripts/gpu_check.py engines --proxy URL --engine a=URL --engine b=URL --out FILE [...]
    python scripts/gpu_check.py pods --pod NAME=PROXY_URL,ENGINE_URL --pod ... --out FILE [--deadline-s S]
    python scripts/gpu_check.py cuda     # exit 0 and the device name when torch sees CUDA, else 1 and why

`engines`: two simulators on the same GPU behind one proxy of `engines:` (each engine's memory its own: NVML's
per-process list, or the simulated file's per-engine entry). Both are put to sleep at the same moment, `a`
lying (its memory stays), and woken again: a's lie must be caught by a's own memory check while b's honest
sleep moves the device's memory at the same time, and b's must pass.

`pods`: two pods on that GPU (docs/gpu-sharing-across-pods.md): two simulators, each behind its own proxy, the
proxies sharing one `gpu_lock_dir`, sized so that one fits awake and two do not. Wakes sent to both at once,
three rounds: one wakes, the other is refused 503 insufficient_gpu_memory before its simulator is asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout

GIB = 1 << 30


@dataclass(frozen=True)
class Step:
    name: str
    method: str
    path: str
    expect_status: int
    expect_state: str
    body: dict[str, Any] | None = None
    arm: str | None = None  # the op whose next call lies about memory (the simulator's lie-memory fault)
    expect_failed_check: str | None = None  # for a 503: which check must have caught it
    expect_memory: str | None = "pass"  # the memory check's result on a 200 that moves memory
    expect_passed: str | None = None  # another check X-Lifeguard-Verified must say passed on a 200


STEPS: tuple[Step, ...] = (
    Step("honest sleep level 1", "POST", "/sleep?level=1", 200, "SLEEPING"),
    Step("honest wake", "POST", "/wake_up", 200, "RUNNING"),
    # vLLM 0.34's process checkpoint: the prepare releases the KV cache, the restore maps it back, checked by vLLM's
    # own snapshot check (docs/verification.md, class 25)
    Step("checkpoint prepare", "POST", "/checkpoint/prepare?mode=abort", 200, "CHECKPOINTED"),
    Step("checkpoint restore", "POST", "/checkpoint/restore", 200, "RUNNING", expect_passed="snapshot"),
    Step("honest sleep level 2", "POST", "/sleep?level=2", 200, "SLEEPING"),
    Step("wake the weights", "POST", "/wake_up?tags=weights", 200, "SLEEPING"),
    Step(
        "reload weights",
        "POST",
        "/collective_rpc",
        200,
        "SLEEPING",
        body={"method": "reload_weights"},
        expect_memory=None,
    ),
    Step("wake the kv cache", "POST", "/wake_up?tags=kv_cache", 200, "RUNNING"),
    Step("lying sleep", "POST", "/sleep?level=1", 503, "SLEEPING", arm="sleep", expect_failed_check="memory"),
    Step("honest wake after the lying sleep", "POST", "/wake_up", 200, "RUNNING"),
    Step("honest sleep before the lying wake", "POST", "/sleep?level=1", 200, "SLEEPING"),
    Step("lying wake", "POST", "/wake_up", 503, "FAILED", arm="wake_up", expect_failed_check="memory"),
)


def judge_step(step: Step, status: int, verified: str | None, state: dict[str, Any]) -> list[str]:
    """What is wrong with one step's outcome; empty when it went as the proxy promises."""
    problems = []
    if status != step.expect_status:
        problems.append(f"status {status}, expected {step.expect_status}")
    if state.get("state") != step.expect_state:
        problems.append(f"proxy state {state.get('state')}, expected {step.expect_state}")
    last = state.get("last_verification") or {}
    checks = {c["name"]: c["result"] for c in last.get("checks", [])}
    if step.expect_failed_check is not None:
        if checks.get(step.expect_failed_check) != "fail":
            problems.append(f"the {step.expect_failed_check} check did not fail: {checks}")
    elif step.expect_memory is not None and status == 200:
        results = dict(part.split("=", 1) for part in (verified or "").split(",") if "=" in part)
        if results.get("memory") != step.expect_memory:
            problems.append(f"memory check {results.get('memory')!r} in X-Lifeguard-Verified {verified!r}")
        if step.expect_passed is not None and results.get(step.expect_passed) != "pass":
            problems.append(f"{step.expect_passed} check {results.get(step.expect_passed)!r} in {verified!r}")
    return problems


async def run_check(proxy: str, engine: str, *, deadline_s: float = 120.0) -> dict[str, Any]:
    """Every step through the proxy, bounded by `deadline_s` in all; returns the report."""
    started = time.monotonic()
    report: dict[str, Any] = {"proxy": proxy, "engine": engine, "steps": [], "ok": False}
    async with ClientSession(timeout=ClientTimeout(total=60)) as http:

        async def get(url: str) -> dict[str, Any]:
            async with http.get(url) as resp:
                body: dict[str, Any] = await resp.json()
                return body

        await _until(lambda: _state_is(get, proxy, "RUNNING"), started + 30, "the proxy to see the engine RUNNING")
        report["engine_info"] = engine_facts(await get(engine + "/sim/state"))
        for step in STEPS:
            if time.monotonic() - started > deadline_s:
                report["error"] = f"out of time before step {step.name!r}"
                return report
            if step.arm:
                async with http.post(engine + "/sim/faults", json=[f"{step.arm}:lie-memory@1"]) as resp:
                    resp.raise_for_status()
            before = engine_facts(await get(engine + "/sim/state"))
            previous = (await get(proxy + "/lifeguard/state")).get("last_verification") or {}
            t0 = time.monotonic()
            async with http.request(step.method, proxy + step.path, json=step.body) as resp:
                status = resp.status
                verified = resp.headers.get("X-Lifeguard-Verified")
                reason = resp.headers.get("X-Lifeguard-Reason")
                text = await resp.text()
            call_s = time.monotonic() - t0
            after = engine_facts(await get(engine + "/sim/state"))
            state = await get(proxy + "/lifeguard/state")
            last = state.get("last_verification") or {}
            if last.get("at") == previous.get("at"):
                last = {}  # this call was not verified (collective_rpc): do not report the previous one
            problems = judge_step(step, status, verified, state)
            report["steps"].append(
                {
                    "step": step.name,
                    "call": f"{step.method} {step.path}",
                    "status": status,
                    "reason": reason,
                    "message": None if status == 200 else _message(text),
                    "verified": verified,
                    "proxy_state": state.get("state"),
                    "call_seconds": round(call_s, 4),
                    "verification_seconds": last.get("seconds"),
                    "verification_checks": last.get("checks"),
                    "proxy_gpu_memory_used_bytes": (state.get("gpu_memory") or {}).get("used_bytes"),
                    "device_used_bytes_before": before["device_used_bytes"],
                    "device_used_bytes_after": after["device_used_bytes"],
                    "engine_flags_after": {"is_sleeping": after["is_sleeping"], "is_paused": after["is_paused"]},
                    "resident_after": after["resident"],
                    "ok": not problems,
                    "problems": problems,
                }
            )
    report["seconds"] = round(time.monotonic() - started, 3)
    report["ok"] = all(s["ok"] for s in report["steps"]) and len(report["steps"]) == len(STEPS)
    return report


async def run_engines_check(proxy: str, engines: dict[str, str], *, deadline_s: float = 120.0) -> dict[str, Any]:
    """Two engines on one GPU: a lying sleep of `a` caught by a's own memory while `b` sleeps honestly beside
    it; then both woken. Returns the report."""
    started = time.monotonic()
    report: dict[str, Any] = {"proxy": proxy, "engines": engines, "steps": [], "ok": False}
    liar, honest = sorted(engines)
    async with ClientSession(timeout=ClientTimeout(total=60)) as http:

        async def get(url: str) -> dict[str, Any]:
            async with http.get(url) as resp:
                body: dict[str, Any] = await resp.json()
                return body

        async def call(name: str, path: str) -> tuple[int, str | None, str]:
            async with http.post(f"{proxy}/engines/{name}{path}") as resp:
                return resp.status, resp.headers.get("X-Lifeguard-Verified"), await resp.text()

        async def both_running() -> bool:
            try:
                state = await get(proxy + "/lifeguard/state")
            except OSError:
                return False
            return all(e.get("state") == "RUNNING" for e in state.get("engines", {}).values()) and len(
                state.get("engines", {})
            ) == len(engines)

        await _until(both_running, started + 60, "the proxy to see both engines RUNNING")
        async with http.post(engines[liar] + "/sim/faults", json=["sleep:lie-memory@1"]) as resp:
            resp.raise_for_status()
        before = {name: engine_facts(await get(url + "/sim/state")) for name, url in engines.items()}
        t0 = time.monotonic()
        (liar_status, _, liar_text), (honest_status, honest_verified, _) = await asyncio.gather(
            call(liar, "/sleep?level=1"), call(honest, "/sleep?level=1")
        )
        sleep_s = time.monotonic() - t0
        after = {name: engine_facts(await get(url + "/sim/state")) for name, url in engines.items()}
        states = {name: await get(f"{proxy}/engines/{name}/lifeguard/state") for name in engines}
        liar_checks = {c["name"]: c["result"] for c in (states[liar].get("last_verification") or {}).get("checks", [])}
        problems = []
        if liar_status != 503 or liar_checks.get("memory") != "fail":
            problems.append(f"{liar}'s lying sleep: status {liar_status}, checks {liar_checks}")
        verified = dict(part.split("=", 1) for part in (honest_verified or "").split(",") if "=" in part)
        if honest_status != 200 or verified.get("memory") != "pass":
            problems.append(f"{honest}'s honest sleep: status {honest_status}, verified {honest_verified!r}")
        report["steps"].append(
            {
                "step": f"{liar} sleeps and lies while {honest} sleeps honestly, at once",
                "statuses": {liar: liar_status, honest: honest_status},
                "message": _message(liar_text) if liar_status != 200 else None,
                "seconds": round(sleep_s, 4),
                "device_used_bytes_before": before[honest]["device_used_bytes"],
                "device_used_bytes_after": after[honest]["device_used_bytes"],
                "own_memory_read": {n: (states[n].get("gpu_memory") or {}).get("used_bytes") for n in engines},
                "checks": {n: (states[n].get("last_verification") or {}).get("checks") for n in engines},
                "ok": not problems,
                "problems": problems,
            }
        )
        problems = []
        for name in (liar, honest):
            status, verified_text, text = await call(name, "/wake_up")
            ok = status == 200
            if not ok:
                problems.append(f"{name}'s wake: {status} {_message(text)}")
        report["steps"].append({"step": "both woken again", "ok": not problems, "problems": problems})
        if time.monotonic() - started > deadline_s:
            report["error"] = "out of time"
    report["seconds"] = round(time.monotonic() - started, 3)
    report["ok"] = all(s["ok"] for s in report["steps"]) and len(report["steps"]) == 2 and "error" not in report
    return report


def judge_race(answers: dict[str, tuple[int, str | None]], wakes_reached: dict[str, int]) -> list[str]:
    """What is wrong with one round of racing wakes (`answers`: per pod, status and reason; `wakes_reached`:
    per pod, wakes its simulator ran in the round); empty when exactly one woke and the others were refused
    for memory before their simulators were asked."""
    problems = []
    won = [pod for pod, (status, _) in answers.items() if status == 200]
    if len(won) != 1:
        problems.append(f"{len(won)} wakes answered 200, expected exactly one: {answers}")
    for pod, (status, reason) in answers.items():
        if status != 200 and (status, reason) != (503, "insufficient_gpu_memory"):
            problems.append(f"{pod}: {status} {reason}, expected 503 insufficient_gpu_memory")
        expected = 1 if status == 200 else 0
        if wakes_reached.get(pod, 0) != expected:
            problems.append(f"{pod}: its simulator ran {wakes_reached.get(pod, 0)} wake(s), expected {expected}")
    return problems


async def run_pods(pods: dict[str, tuple[str, str]], *, rounds: int = 3, deadline_s: float = 120.0) -> dict[str, Any]:
    """Racing wakes through each pod's proxy (`pods`: name -> (proxy URL, engine URL)), `rounds` times, the
    winner put to sleep through its own proxy between rounds; returns the report."""
    started = time.monotonic()
    report: dict[str, Any] = {"pods": {name: {"proxy": p, "engine": e} for name, (p, e) in pods.items()},
                              "rounds": [], "ok": False}  # fmt: skip
    async with ClientSession(timeout=ClientTimeout(total=60)) as http:

        async def get(url: str) -> dict[str, Any]:
            async with http.get(url) as resp:
                body: dict[str, Any] = await resp.json()
                return body

        async def post(url: str) -> tuple[int, str | None, str]:
            async with http.post(url) as resp:
                return resp.status, resp.headers.get("X-Lifeguard-Reason"), await resp.text()

        for name, (proxy, _) in pods.items():

            async def asleep(proxy: str = proxy) -> bool:
                return await _state_is(get, proxy, "SLEEPING")

            await _until(asleep, started + 30, f"{name}'s proxy to see its engine asleep")
        for number in range(rounds):
            if time.monotonic() - started > deadline_s:
                report["error"] = f"out of time before round {number + 1}"
                return report
            before = {name: (await get(engine + "/sim/state"))["counters"].get("wake_up", 0)
                      for name, (_, engine) in pods.items()}  # fmt: skip
            t0 = time.monotonic()
            results = await asyncio.gather(*(post(proxy + "/wake_up") for proxy, _ in pods.values()))
            seconds = time.monotonic() - t0
            answers = {name: (status, reason) for name, (status, reason, _) in zip(pods, results, strict=True)}
            engines = {name: await get(engine + "/sim/state") for name, (_, engine) in pods.items()}
            reached = {name: engines[name]["counters"].get("wake_up", 0) - before[name] for name in pods}
            states = {name: await get(proxy + "/lifeguard/state") for name, (proxy, _) in pods.items()}
            problems = judge_race(answers, reached)
            report["rounds"].append(
                {
                    "answers": {
                        name: {"status": st, "reason": rs, "message": None if st == 200 else _message(tx)}
                        for name, (st, rs, tx) in zip(pods, results, strict=True)
                    },  # fmt: skip
                    "wakes_reached_the_simulator": reached,
                    "seconds": round(seconds, 3),
                    "device_used_bytes_after": {name: e["memory"]["used_bytes"] for name, e in engines.items()},
                    "gpu_lock": {name: s.get("gpu_lock") for name, s in states.items()},
                    "ok": not problems,
                    "problems": problems,
                }
            )
            for name, (status, _) in answers.items():
                if status == 200:  # the next round races again from both asleep
                    status, reason, text = await post(pods[name][0] + "/sleep?level=1")
                    if status != 200:
                        report["error"] = f"{name}: its sleep after round {number + 1}: {status} {reason} {text[:200]}"
                        return report
    report["seconds"] = round(time.monotonic() - started, 3)
    report["ok"] = len(report["rounds"]) == rounds and all(r["ok"] for r in report["rounds"])
    return report


def engine_facts(state: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of the simulator's `/sim/state`: its flags and its device's memory."""
    memory = state["memory"]
    return {
        "is_sleeping": state["is_sleeping"],
        "is_paused": state["paused"],
        "asleep_tags": state["asleep_tags"],
        "device_used_bytes": memory["used_bytes"],
        "device_total_bytes": memory["total_bytes"],
        "resident": memory["resident"],
    }


async def _state_is(get: Callable[[str], Awaitable[dict[str, Any]]], proxy: str, name: str) -> bool:
    try:
        return (await get(proxy + "/lifeguard/state")).get("state") == name
    except OSError:
        return False


async def _until(predicate: Callable[[], Awaitable[bool]], deadline: float, what: str) -> None:
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


def cuda_available() -> tuple[bool, str]:
    """Whether torch can use a CUDA device here, and why not when it cannot."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, str(torch.cuda.get_device_name(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="drive the proxy through the steps and write the figures")
    check.add_argument("--proxy", required=True)
    check.add_argument("--engine", required=True)
    check.add_argument("--out", type=Path, required=True)
    check.add_argument("--deadline-s", type=float, default=120.0)
    check.add_argument("--extra", default="{}", help="JSON merged into the report (mode, probe, ...)")
    engines = sub.add_parser("engines", help="two engines on one GPU: one's lying sleep caught by its own memory")
    engines.add_argument("--proxy", required=True)
    engines.add_argument("--engine", action="append", required=True, help="NAME=URL, twice")
    engines.add_argument("--out", type=Path, required=True)
    engines.add_argument("--deadline-s", type=float, default=120.0)
    engines.add_argument("--extra", default="{}", help="JSON merged into the report (mode, probe, ...)")
    pods = sub.add_parser("pods", help="race wakes through two pods' proxies on one GPU and write the figures")
    pods.add_argument("--pod", action="append", required=True, metavar="NAME=PROXY_URL,ENGINE_URL")
    pods.add_argument("--out", type=Path, required=True)
    pods.add_argument("--deadline-s", type=float, default=120.0)
    pods.add_argument("--extra", default="{}", help="JSON merged into the report")
    sub.add_parser("cuda", help="print whether CUDA is usable here (exit 0) or why not (exit 1)")
    args = parser.parse_args(argv)

    if args.command == "cuda":
        usable, why = cuda_available()
        print(why)
        return 0 if usable else 1
    if args.command == "pods":
        named = dict(spec.split("=", 1) for spec in args.pod)
        pod_urls = {name: tuple(value.split(",", 1)) for name, value in named.items()}
        try:
            report = asyncio.run(run_pods({n: (u[0], u[1]) for n, u in pod_urls.items()}, deadline_s=args.deadline_s))
        except (TimeoutError, OSError) as exc:
            report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "rounds": []}
        report.update(json.loads(args.extra))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        for number, race in enumerate(report["rounds"], 1):
            answers = ", ".join(f"{n} {a['status']} {a['reason'] or ''}".strip() for n, a in race["answers"].items())
            print(f"{'ok  ' if race['ok'] else 'FAIL'} round {number}: {answers}  {'; '.join(race['problems'])}")
        if report.get("error"):
            print(f"error: {report['error']}", file=sys.stderr)
        print(f"{'PASS' if report['ok'] else 'FAIL'}: two pods, figures in {args.out}")
        return 0 if report["ok"] else 1
    try:
        if args.command == "engines":
            urls = dict(item.split("=", 1) for item in args.engine)
            report = asyncio.run(run_engines_check(args.proxy, urls, deadline_s=args.deadline_s))
        else:
            report = asyncio.run(run_check(args.proxy, args.engine, deadline_s=args.deadline_s))
    except (TimeoutError, OSError) as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "steps": []}
    report.update(json.loads(args.extra))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.command == "engines":
        for step in report["steps"]:
            print(f"{'ok  ' if step['ok'] else 'FAIL'} {step['step']}  {'; '.join(step['problems'])}")
        print(f"{'PASS' if report['ok'] else 'FAIL'}: figures in {args.out}")
        return 0 if report["ok"] else 1
    for step in report["steps"]:
        mark = "ok  " if step["ok"] else "FAIL"
        print(
            f"{mark} {step['step']:<36} {step['status']} {step['proxy_state']:<9} "
            f"device {step['device_used_bytes_before'] / GIB:6.2f} -> {step['device_used_bytes_after'] / GIB:6.2f} GiB"
            f"  verify {step['verification_seconds']} s  {'; '.join(step['problems'])}"
        )
    if report.get("error"):
        print(f"error: {report['error']}", file=sys.stderr)
    print(f"{'PASS' if report['ok'] else 'FAIL'}: figures in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
