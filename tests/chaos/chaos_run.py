"""The chaos run: the proxy in front of a crashing, lying, hanging simulator, under load, for a bounded time.

    python -m tests.chaos.chaos_run --duration 600          # the full run
    python -m tests.chaos.chaos_run --quick                 # the bounded CI run (~90 s)
    python -m tests.chaos.chaos_run --engines 2 --quick     # two engines on one GPU, 110 s (make chaos-engines)

Processes: the simulator (tests/chaos/sim_process.py: `vllm-lifeguard sim` plus a crash-proof journal)
under a restarter, and `vllm-lifeguard serve --upstream ... --gpu-probe file:GPUFILE`, which is killed -9
and started again on the same port at random moments (tests/chaos/chaos_proxy.py). Actors: clients
(streaming and not, some leaving early), trainers (random lifecycle sequences, repeats, out-of-order
calls, weight-update sessions), a fault injector (every fault kind in turn) and a healer (restarts an
engine that stays FAILED). Then a quiet settle, a recovery to RUNNING, and the invariants
(docs/reliability.md says what each means). Prints the figures; exits 1 if any invariant broke.

With `--engines 2`: two simulators (model-a, model-b) share one GPU file whose device fits one awake, behind
one `vllm-lifeguard serve` with `engines:` (LIFEGUARD_ENGINES); clients ask for both models at random through
the top-level URL (swaps), trainers call /engines/<name>/..., each simulator has its fault injector and
healer. The invariants hold per engine, plus never more awake than fits, from both journals' memory moves.
No proxy restarts in this mode.

With `--pods N` (2 or 3; make chaos-pods): N pods on one GPU node, each a simulator and its own proxy (one
engine each, `engines:` of one), all simulators on one GPU file that fits one awake, all proxies on one
`gpu_lock_dir`; each proxy is killed -9 and restarted on its own schedule. Clients of each pod ask for its
model (a sleeping one is woken on request, admitted against the device's memory under the node's lock),
trainers and faults per engine, and an orchestrator that gives each engine the GPU in turn (the others put
to sleep, then it is woken, each through its own pod's proxy), racing the wakes the pods' requests ask for.
The invariants hold per engine, plus never more awake than fits and never two wakes overlapping on one GPU
(from the simulators' journals).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.chaos.chaos_actors import (
    FAULT_OPS,
    SHARED_SIZES,
    SimSupervisor,
    Tally,
    client,
    fault_injector,
    healer,
    lifecycle_call,
    orchestrator,
    proxy_state,
    sim_state,
    trainer,
)
from tests.chaos.chaos_checks import (
    BAD_INFERENCE,
    KNOWN_BUGS,
    Call,
    Journal,
    cut_by_restart,
    engine_matches,
    known_violation,
    more_awake_than_fits,
    on_failing_checksums,
    only_kept_requests,
    overlapping_wakes,
    read_journal,
    session_cut,
    untruthful,
    wake_intervals,
)
from tests.chaos.chaos_proxy import ProxySupervisor, proxy_killer

PROXY_ENV = {
    "LIFEGUARD_HOLD_TIMEOUT_S": "5",
    "LIFEGUARD_RECONCILE_INTERVAL_S": "0.3",
    "LIFEGUARD_VERIFY_TIMEOUT_S": "1.5",
    "LIFEGUARD_VERIFY_POLL_INTERVAL_S": "0.02",
    "LIFEGUARD_LIFECYCLE_CALL_TIMEOUT_S": "8",
    "LIFEGUARD_LIFECYCLE_QUEUE_TIMEOUT_S": "20",
    "LIFEGUARD_CONTROL_CALL_TIMEOUT_S": "2",
    "LIFEGUARD_CANARY_TIMEOUT_S": "3",
    "LIFEGUARD_WEIGHT_CHECKSUMS": "always",  # every level-1 wake, reload and session compared (the lie-weights fault)
    "LIFEGUARD_WEIGHT_CHECKSUM_TIMEOUT_S": "3",
    "LIFEGUARD_MAX_HELD_REQUESTS": "400",
    "LIFEGUARD_SHUTDOWN_GRACE_S": "3",
    "LIFEGUARD_LOG_LEVEL": os.environ.get("CHAOS_PROXY_LOG_LEVEL", "warning"),  # info: every lifecycle op
}
# A request's deadline: the hold deadline, plus a hang the operator ends by a restart, plus a generation
# frozen by a `keep` pause until a trainer lifts it. Past this, it counts as a hang.
INFERENCE_DEADLINE_S = 45.0
# Queue deadline (20 s) + call deadline (8 s) + verification + slack.
LIFECYCLE_DEADLINE_S = 60.0
GIB = 1 << 30
UPDATE = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
# Why a wake may be refused for lack of room (issue 26; the words of proxy/sharing/swap_rules.py and arbiter.py):
# a neighbour that cannot be put to sleep now, memory no neighbour of this proxy holds, or a sleep or wake that
# failed. A neighbour that is only serving, or has requests held for it, is no reason: requests wait their turn.
ROOM_REFUSALS = (
    "(pinned)",
    "(in a weight update, or it failed to sleep)",
    "(waking or updating weights)",
    "(partly awake",
    "(asleep, its memory not freed",
    "(failed or starting)",
    "(asleep)",
    "memory held outside this proxy",
    "would free only",
    "could not be put to sleep to make room",
    "ran out of GPU memory waking up",
)
# With several engines (--engines N): what one takes on the shared device awake, and asleep.
SHARED_AWAKE = int(sum(SHARED_SIZES[k] for k in ("weights_gib", "kv_gib", "overhead_gib")) * GIB)
SHARED_ASLEEP = int(SHARED_SIZES["overhead_gib"] * GIB)


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


@dataclass
class Guarded:
    """One engine of the run: its simulator, its base URL on the proxy, and what the run found about it."""

    name: str  # "": the one engine of the single-engine run
    sim: SimSupervisor
    base: str  # the proxy, or /engines/<name> on it
    proxy_base: str  # its proxy (with --pods, each engine's own)
    settle: str | None = "never compared"
    recovered: bool = False
    leftover: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"[{self.name}] " if self.name else ""


def engines_config(engines: list[Guarded]) -> list[dict[str, Any]]:
    """`engines:` of the proxy (LIFEGUARD_ENGINES): all on GPU 0; the first swapped out at level 1, the
    others at level 2 (woken with a weight reload), so both kinds of swap run."""
    return [{"name": e.name, "upstream": e.sim.url, "gpus": [0], "models": [e.sim.model],
             "swap_sleep_level": 1 if i == 0 else 2} for i, e in enumerate(engines)]  # fmt: skip


def pod_config(e: Guarded) -> list[dict[str, Any]]:
    """`engines:` of one pod's proxy (--pods): its one engine, its awake footprint known (admission across pods
    counts what another pod holds only against a known need; docs/gpu-sharing-across-pods.md)."""
    return [{"name": e.name, "upstream": e.sim.url, "gpus": [0], "models": [e.sim.model],
             "footprint_gib": SHARED_AWAKE / GIB}]  # fmt: skip


async def run(args: argparse.Namespace, workdir: Path) -> int:
    count = max(args.engines, args.pods)
    names = [chr(ord("a") + i) for i in range(count)] if count > 1 else [""]
    one_proxy = f"http://127.0.0.1:{free_port()}"
    bases = {name: f"http://127.0.0.1:{free_port()}" if args.pods > 1 else one_proxy for name in names}
    engines = [Guarded(name, SimSupervisor(free_port(), workdir, args.seed + 7919 * i, name),
                       bases[name] + (f"/engines/{name}" if name else ""), bases[name])
               for i, name in enumerate(names)]  # fmt: skip
    base = one_proxy if args.pods <= 1 else ""  # the one URL of every model (not with --pods: one per pod)
    models = {e.sim.model: e.name for e in engines}
    tally = Tally()
    proxies: dict[str, ProxySupervisor] = {}  # by engine name; one shared by every engine but with --pods
    stop_restarter = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
    restarters: list[asyncio.Task[None]] = []
    try:
        probe = f"file:{engines[0].sim.gpu_file}"
        if args.pods > 1:
            lock_dir = workdir / "gpu-locks"  # the node's hostPath
            lock_dir.mkdir(exist_ok=True)
            for e in engines:
                cmd = [*proxy_command(), "serve", "--port", e.proxy_base.rsplit(":", 1)[1], "--gpu-probe", probe]
                state_file = str(workdir / f"proxy-{e.name}-state.json")
                env = {**os.environ, **PROXY_ENV, "LIFEGUARD_STATE_FILE": state_file,
                       "LIFEGUARD_ENGINES": json.dumps(pod_config(e)),
                       "LIFEGUARD_GPU_LOCK_DIR": str(lock_dir)}  # fmt: skip
                proxies[e.name] = ProxySupervisor(cmd, env, workdir / f"proxy-{e.name}.log", e.proxy_base)
        else:
            cmd = [*proxy_command(), "serve", "--port", one_proxy.rsplit(":", 1)[1], "--gpu-probe", probe]
            env = {**os.environ, **PROXY_ENV, "LIFEGUARD_STATE_FILE": str(workdir / "proxy-state.json")}
            if args.engines > 1:
                env["LIFEGUARD_ENGINES"] = json.dumps(engines_config(engines))
                # The default drain (none before a client's sleep); the turn scaled to this run's 5 s hold deadline.
                env["LIFEGUARD_SWAP_QUANTUM_S"] = "1"
            else:
                cmd += ["--upstream", engines[0].sim.url]
            shared = ProxySupervisor(cmd, env, workdir / "proxy.log", one_proxy)
            proxies = {e.name: shared for e in engines}
        started_proxies: set[int] = set()
        for e in engines:
            # On a shared GPU only one fits awake: each but the last is put to sleep before the next starts, by its
            # proxy, which saw it start (a sidecar starts with its engine): the wake it verifies first is compared
            # with checksums taken before the sleep. A sleep sent behind the proxy's back leaves it none (seed 1514
            # of make chaos-pods: a lie-weights first wake ran the canary on altered weights).
            e.sim.start()
            await e.sim.wait_healthy(session)
            if id(proxies[e.name]) not in started_proxies:
                started_proxies.add(id(proxies[e.name]))
                proxies[e.name].start()
            if e.name and e is not engines[-1]:
                await wait_until(f"{e.label}proxy RUNNING", lambda e=e: proxy_in(session, e, "RUNNING"), 30)
                await proxy_sleep(session, e)
        restarters = [asyncio.create_task(e.sim.restarter(stop_restarter), name="restarter") for e in engines]
        expected = {e.name: "SLEEPING" if e.name and e is not engines[-1] else "RUNNING" for e in engines}

        async def ready() -> bool:
            states = [await proxy_state(session, e.base) for e in engines]
            return all(s is not None and s["state"] == expected[e.name] for e, s in zip(engines, states, strict=True))

        await wait_until("proxy RUNNING", ready, 30)
        started = time.monotonic()
        sims = ", ".join(f"{e.label}{e.proxy_base if args.pods > 1 else ''} -> {e.sim.url}" for e in engines)
        print(f"chaos: proxy {base or 'per pod'}, sims {sims}; {args.clients} clients, {args.trainers} trainers, "
              f"{args.duration:g} s; workdir {workdir}", flush=True)  # fmt: skip
        if args.pods > 1:
            print(
                f"chaos: {args.pods} pods (a proxy and a simulator each) on one GPU file ({engines[0].sim.gpu_file}), "
                f"one fits awake, one gpu_lock_dir; each pod's clients ask for its model; proxy restarts per pod",
                flush=True,
            )
        elif args.engines > 1:
            print(
                f"chaos: {args.engines} engines on one GPU file ({engines[0].sim.gpu_file}), one fits awake; "
                "models at random through the top-level URL; proxy restarts left out of this mode",
                flush=True,
            )

        stop_load = asyncio.Event()
        stop_chaos = asyncio.Event()
        # With --pods each client is one pod's (its proxy, its model); otherwise every model through the one URL.
        targets = [(e.proxy_base, {e.sim.model: e.name}) for e in engines] if args.pods > 1 else [(base, models)]
        clients = [
            asyncio.create_task(
                client(
                    session,
                    targets[i % len(targets)][0],
                    args.seed * 1000 + i,
                    tally,
                    stop_load,
                    INFERENCE_DEADLINE_S,
                    targets[i % len(targets)][1],
                )
            )  # fmt: skip
            for i in range(args.clients)
        ]
        per_engine = -(-args.trainers // len(engines))  # with several engines: as many for each, rounded up
        chaos = [
            asyncio.create_task(
                trainer(
                    session, e.base, args.seed * 2000 + j * 100 + i, tally, stop_chaos, LIFECYCLE_DEADLINE_S, e.name
                )
            )  # fmt: skip
            for j, e in enumerate(engines)
            for i in range(per_engine)
        ]
        for j, e in enumerate(engines):
            chaos.append(asyncio.create_task(fault_injector(session, e.sim, args.seed + 7919 * j, tally, stop_chaos)))
            others = tuple((o.name, o.base) for o in engines if o is not e)
            chaos.append(asyncio.create_task(healer(session, e.base, e.sim, tally, stop_chaos, neighbours=others)))
        if args.pods > 1:
            chaos.append(asyncio.create_task(orchestrator(session, [(e.name, e.base) for e in engines], args.seed,
                                                          tally, stop_chaos, LIFECYCLE_DEADLINE_S)))  # fmt: skip
        if args.proxy_restarts:
            every = (6.0, 15.0) if args.quick else (8.0, 20.0)
            for j, (name, proxy) in enumerate({id(p): (n, p) for n, p in proxies.items()}.values()):

                def lifecycle_in_flight(name: str = name) -> bool:
                    return any(c.kind != "inference" and c.outcome == "pending" and (args.pods <= 1 or c.engine == name)
                               for c in tally.calls[-300:])  # fmt: skip

                chaos.append(asyncio.create_task(proxy_killer(session, proxy, args.seed + 31 * j, every,
                                                              lifecycle_in_flight, stop_chaos)))  # fmt: skip
        progress_every = max(10.0, args.duration / 10)
        next_progress = started + progress_every
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(0.5)
            if time.monotonic() >= next_progress:
                next_progress += progress_every
                ops = sum(1 for c in tally.calls if c.kind != "inference")
                print(f"  t={time.monotonic() - started:5.0f}s requests={tally.sent} lifecycle={ops} "
                      f"restarts={sum(e.sim.restarts for e in engines)}", flush=True)  # fmt: skip
        chaos_seconds = time.monotonic() - started

        # 1. Quiet: no lifecycle call, no fault; clients go on. The proxy must come to agree with the engine.
        # With several engines the clients stop first: their traffic for every model swaps engines all along.
        # Requests a vLLM keeps for a pause or a sleep the trainers left end only with the recovery.
        stop_chaos.set()
        await asyncio.wait_for(asyncio.gather(*chaos), LIFECYCLE_DEADLINE_S + 10)
        if count > 1:
            stop_load.set()
            await clients_ended_or_kept(session, engines, tally, INFERENCE_DEADLINE_S + 10)
        for e in engines:
            cut = session_cut([c for c in tally.calls if c.engine == e.name], proxies[e.name].downtimes)
            e.settle = await settle_and_compare(session, e.base, e.sim, cut)

        # 2. Recovery through the proxy's own routes, then traffic must flow again (for every model in turn).
        last = await recover_all(session, engines, tally, across_pods=args.pods > 1)
        stop_load.set()
        await asyncio.wait_for(asyncio.gather(*clients), INFERENCE_DEADLINE_S + 10)
        final_ok = 0
        for i in range(10):
            # Through one proxy, the models in turn (swaps); across pods, the one left awake by the recovery (a
            # lifeguard does not put another pod's engine to sleep).
            model, url = (last.sim.model, last.proxy_base) if args.pods > 1 else (list(models)[i % len(models)], base)
            try:
                body = {"model": model, "prompt": "ok", "max_tokens": 2}
                async with session.post(
                    url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=15)
                ) as resp:
                    final_ok += resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                pass

        for e in engines:

            async def drained(e: Guarded = e) -> dict[str, Any] | None:
                state = await proxy_state(session, e.base)
                return state if state and state["held_requests"] == 0 and state["inflight_requests"] == 0 else None

            try:
                e.leftover = await wait_until("nothing held or in flight", drained, 10)
            except RuntimeError:
                e.leftover = await proxy_state(session, e.base)
        texts = [await fetch_text(session, url + "/lifeguard/metrics") for url in sorted(set(bases.values()))]
        metrics_text = "\n".join(texts)
    finally:
        stop_restarter.set()
        for task in restarters:
            await task
        stopped = {id(p): p.stop() for p in proxies.values()}
        for e in engines:
            e.sim.stop()
        await session.close()

    journals = {e.name: read_journal(e.sim.journal, e.name) for e in engines}
    downtimes = {name: proxy.downtimes for name, proxy in proxies.items()}
    return report(args, tally, engines, journals, chaos_seconds, final_ok, list(stopped.values()), metrics_text,
                  workdir, downtimes)  # fmt: skip


async def proxy_in(session: aiohttp.ClientSession, e: Guarded, state: str) -> bool:
    found = await proxy_state(session, e.base)
    return found is not None and found["state"] == state


async def proxy_sleep(session: aiohttp.ClientSession, e: Guarded) -> None:
    """Put an engine to sleep through its proxy before the run, as a trainer's setup would."""
    async with session.post(e.base + "/sleep?level=1&mode=abort", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{e.label}sleep through the proxy before the run: {resp.status} {await resp.text()}")


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def clients_ended_or_kept(session: aiohttp.ClientSession, engines: list[Guarded], tally: Tally,
                                timeout: float) -> None:  # fmt: skip
    """Wait, the load stopped, until no client request is open but those a vLLM keeps (`only_kept_requests`),
    twice in a row: a request on its way to a proxy when the first look came is counted by the second."""

    async def quiet() -> bool:
        pending = Counter(c.engine for c in tally.calls if c.kind == "inference" and c.outcome == "pending")
        if not pending:
            return True
        states = {e.name: await proxy_state(session, e.base) for e in engines}
        return only_kept_requests(pending, states)

    async def twice() -> bool:
        if not await quiet():
            return False
        await asyncio.sleep(0.2)
        return await quiet()

    await wait_until("the clients' requests ended (or kept by a paused or sleeping vLLM)", twice, timeout)


async def settle_and_compare(session: aiohttp.ClientSession, base: str, sim: SimSupervisor,
                             session_unknowable: bool) -> str | None:  # fmt: skip
    """Poll until the proxy's settled state equals the engine's twice in a row; the mismatch if it never does."""
    await asyncio.sleep(1.0)  # the run's own pacing: let the last reconcile rounds happen
    deadline = time.monotonic() + 20
    last = "never compared"
    agreed = 0
    while time.monotonic() < deadline:
        proxy, engine = await proxy_state(session, base), await sim_state(session, sim)
        if sim.waiting_for_room:  # dead beside an awake engine until the recovery makes room for it
            engine = {"dead": True, "asleep_tags": [], "weight_update_active": False}
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


async def recover_all(session: aiohttp.ClientSession, engines: list[Guarded], tally: Tally, *,
                      across_pods: bool = False) -> Guarded:  # fmt: skip
    """Recover every engine through the proxy; with several, a FAILED one first (dead awake, it leaves no
    room for a wake), then one with requests inside vLLM (a trainer's keep-mode sleep froze them: they wait for
    its wake, and recovering the others first ran them past their deadline: seed 8904),
    in up to three rounds. Recovering one puts the one recovered before to sleep (one fits awake): each has to
    come back to RUNNING once; the final requests then swap them in turn. Across pods nothing puts another pod's
    engine to sleep: the operator does, through that pod's proxy, before each recovery. The engine recovered last
    (the one awake at the end)."""
    last = engines[-1]
    for _ in range(3):
        states = {e.name: await proxy_state(session, e.base) or {} for e in engines}
        order = sorted(
            engines,
            key=lambda e: (states[e.name].get("state") != "FAILED", not states[e.name].get("inflight_requests")),
        )
        for e in order:
            if across_pods:
                for other in engines:
                    if other is not e:
                        await lifecycle_call(session, other.base, "sleep", [("level", "1")], None, tally,
                                             LIFECYCLE_DEADLINE_S, other.name)  # fmt: skip
            if e.sim.waiting_for_room:  # dead while another is awake: an operator makes room for its restart
                for other in engines:
                    if other is not e:
                        await lifecycle_call(session, other.base, "sleep", [("level", "1")], None, tally,
                                             LIFECYCLE_DEADLINE_S, other.name)  # fmt: skip

                async def restarted(e: Guarded = e) -> bool:
                    return not e.sim.waiting_for_room

                with contextlib.suppress(RuntimeError):
                    await wait_until("room for a restart", restarted, 5)
            e.recovered = await recover(session, e.base, e.sim, tally, e.name)
            last = e
        if all(e.recovered for e in engines):
            return last
    return last


async def recover(session: aiohttp.ClientSession, base: str, sim: SimSupervisor, tally: Tally,
                  engine: str = "") -> bool:  # fmt: skip
    """Bring the engine back to RUNNING with fresh weights the way a trainer would, through the proxy. Weights held
    for a caught checksum mismatch come back with a reload of the checkpoint; if that reload fails its own checksums
    (the checkpoint on disk is not the one the proxy read: a restart of vLLM no one saw, seed 399 of make
    chaos-engines), the trainer pushes its weights in a session instead (docs/reliability.md)."""

    async def call(op: str, body: Any = None) -> Call:
        return await lifecycle_call(session, base, op, [], body, tally, LIFECYCLE_DEADLINE_S, engine)

    reload_failed = False
    for _ in range(30):
        state = await proxy_state(session, base)
        if state is None:
            await asyncio.sleep(0.2)
            continue
        name = state["state"]
        if name == "RUNNING" and not state["weights_stale"]:
            return True
        if name == "UPDATING_WEIGHTS":
            await call("finish_weight_update")
        elif name == "SLEEPING":
            await call("wake_up")
        elif name == "PAUSED":
            await call("resume")
        elif name == "RUNNING" and reload_failed:
            for op, body in (("start_weight_update", None), ("update_weights", UPDATE), ("finish_weight_update", None)):
                await call(op, body)
            reload_failed = False
        elif name == "RUNNING":
            reload = await call("collective_rpc", {"method": "reload_weights"})
            reload_failed = reload.reason == "verification_failed"
        elif name == "FAILED":
            sim.kill()
            await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(0.2)
    return False


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Each sample of the Prometheus series `name` in `text`: its labels and its value."""
    samples = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0])) if "{" in line else {}
            samples.append((labels, float(line.rsplit(" ", 1)[1])))
    return samples


def metric_sum(text: str, name: str) -> float:
    return sum(value for _, value in metric_samples(text, name))


def report(
    args: argparse.Namespace,
    tally: Tally,
    engines: list[Guarded],
    journals: dict[str, Journal],
    seconds: float,
    final_ok: int,
    proxy_rcs: list[int | None],
    metrics_text: str,
    workdir: Path,
    downtimes_of: dict[str, list[tuple[float, float]]],
) -> int:
    inference = [c for c in tally.calls if c.kind == "inference"]
    lifecycle = [c for c in tally.calls if c.kind != "inference"]
    outcomes = Counter(c.outcome for c in inference)
    reasons = Counter(f"{c.status} {c.reason}" for c in tally.calls if c.reason)
    by_op = Counter(f"{c.kind}:{c.outcome}" for c in lifecycle)
    proxy_500 = [c for c in tally.calls if c.status == 500 and c.reason]
    known: Counter[str] = Counter()
    proxy_bugs = [c for c in tally.calls if c.reason == "proxy_error"]
    downtimes = sorted({d for ds in downtimes_of.values() for d in ds})  # every restart of every proxy
    cut = [c for c in tally.calls if cut_by_restart(c, downtimes_of[c.engine])]
    bad_inference = [c for c in inference if (c.outcome in BAD_INFERENCE or c.outcome == "pending") and c not in cut]
    bad_lifecycle = [c for c in lifecycle if c.outcome not in ("ok", "noop", "proxy_error") and c not in cut]
    latencies = sorted(c.t_end - c.t_send for c in inference if c.outcome == "ok")

    def p(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    kinds = sorted(FAULT_OPS)
    counted = metric_sum(metrics_text, "lifeguard_inference_requests_total")
    several = len(engines) > 1

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
    truth: dict[str, tuple[int, list[tuple[Call, str]]]] = {}
    for e in engines:
        journal = journals[e.name]
        calls = [c for c in tally.calls if c.engine == e.name]
        truth[e.name] = untruthful([c for c in calls if c.kind != "inference"], journal.timeline)
        if several:
            mine = Counter(c.outcome for c in calls if c.kind == "inference")
            print(f"{e.label}requests           {sum(mine.values())}: {dict(sorted(mine.items()))}")
            print(f"{e.label}lifecycle calls    {len(calls) - sum(mine.values())}")
            errors = Counter(f"{c.status} {c.reason}" for c in calls if c.reason)
            print(f"{e.label}proxy errors       {dict(sorted(errors.items()))}")
        print(f"{e.label}faults fired           {dict(sorted(journal.faults_fired.items()))}")
        print(f"{e.label}engine deaths/restarts {len(journal.deaths)} simulated deaths, {e.sim.restarts} restarts")
        print(f"{e.label}lifecycle 200s checked {truth[e.name][0]} against {len(journal.timeline)} engine states")
    print(f"operator kills         {dict(tally.kills)}")
    cut_kinds = Counter("inference" if c.kind == "inference" else "lifecycle" for c in cut)
    if several and not args.pods > 1:
        print("proxy restarts         left out of this mode (several engines)")
    else:
        print(f"proxy restarts         {len(downtimes)} kill -9 + restart on the same port; calls cut (connection "
              f"error): {dict(cut_kinds)}")  # fmt: skip
    moves = [move for journal in journals.values() for move in journal.memory]
    peak, total, over = more_awake_than_fits(moves)
    swaps: Counter[str] = Counter()
    if several:
        for labels, value in metric_samples(metrics_text, "lifeguard_swaps_total"):
            if value:
                swaps[f"{labels.get('engine')}:{labels.get('outcome')}"] += int(value)
        no_room = Counter(c.engine for c in tally.calls if c.reason == "insufficient_gpu_memory")
        print(f"swaps by engine:outcome {dict(sorted(swaps.items()))}  (the last proxies' lifeguard_swaps_total)")
        print(f"503 insufficient_gpu_memory by engine {dict(sorted(no_room.items()))}")
        print(f"wakes the device refused (out of memory) { ({n: j.ooms for n, j in journals.items()}) }")
        print(f"restarts that waited for room { ({e.name: e.sim.waits_for_room for e in engines}) }")
        print(f"device memory          peak {peak / GIB:.1f} GiB of {total / GIB:.1f} GiB over {len(moves)} memory "
              f"moves (one engine awake: {SHARED_AWAKE / GIB:.0f} GiB, "
              f"asleep: {SHARED_ASLEEP / GIB:.0f} GiB)")  # fmt: skip
    wakes = {e.name: wake_intervals(journals[e.name]) for e in engines}
    overlaps = overlapping_wakes(wakes, downtimes_of) if args.pods > 1 else []
    if args.pods > 1:
        waits: Counter[str] = Counter()
        for labels, value in metric_samples(metrics_text, "lifeguard_gpu_lock_waits_total"):
            waits[labels.get("outcome", "")] += int(value)
        print(f"wakes on the GPU       {sum(len(w) for w in wakes.values())} in the simulators' journals "
              f"({ {n: len(w) for n, w in wakes.items()} }); node lock waits by outcome (the last proxies') "
              f"{dict(sorted(waits.items()))}")  # fmt: skip

    broken: list[str] = []
    first_calls: list[str] = []

    def check(ok: bool, text: str, detail: list[str] | None = None) -> None:
        print(f"  [{'ok' if ok else 'BROKEN'}] {text}")
        if not ok:
            broken.append(text)
            for line in (detail or [])[:10]:
                print(f"           {line}")
            # Again in the last lines: CI keeps only a log's head and tail, and the broken calls say why.
            first_calls.extend((detail or [])[:3])

    def show(calls: list[Call]) -> list[str]:
        return [f"{c.engine}{' ' if c.engine else ''}{c.kind} {c.query} -> {c.status} {c.outcome} {c.reason or ''} "
                f"{c.detail} (sent {time.strftime('%H:%M:%S', time.gmtime(c.t_send))}, {c.t_end - c.t_send:.1f} s)"
                for c in calls]  # fmt: skip

    print("\n=== invariants ===")
    check(tally.sent == tally.ended, f"sent == ended ({tally.sent} == {tally.ended}); 0 requests lost")
    check(not bad_inference, f"every request ended as upstream's answer or a proxy error with a reason "
          f"({len(bad_inference)} did not)", show(bad_inference))  # fmt: skip
    check(not [c for c in inference if c.outcome == "hang"], f"0 hangs past the {INFERENCE_DEADLINE_S:g} s deadline")
    check(not proxy_500, f"0 proxy-made 500s ({len(proxy_500)})", show(proxy_500))
    check(not proxy_bugs, f"0 unexpected proxy errors (reason proxy_error: {len(proxy_bugs)})", show(proxy_bugs))
    check(not bad_lifecycle, f"every lifecycle call answered: 200, or a proxy error with a reason "
          f"({len(bad_lifecycle)} not)", show(bad_lifecycle))  # fmt: skip
    for e in engines:
        journal = journals[e.name]
        violations = []
        for v in journal.violations:
            bug = "" if args.strict else known_violation(v, journal.pausing)
            known[bug] += bool(bug)
            if not bug:
                violations.append(v)
        altered, violations = on_failing_checksums(violations)
        check(not violations, f"{e.label}simulator violations empty ({len(violations)}; known core bugs aside)",
              [json.dumps(v) for v in violations])  # fmt: skip
        check(not altered, f"{e.label}no 200 from weights that fail their checksums ({len(altered)} generations ran "
              "on them)", [json.dumps(v) for v in altered])  # fmt: skip
        checked, lies = truth[e.name]
        real_lies = [c for c, bug in lies if args.strict or not bug]
        known.update(bug for _, bug in lies if bug and not args.strict)
        shown = [f"{c.kind}?{c.query} noop={c.noop} deferred={c.deferred}: {c.detail}" for c in real_lies]
        check(not real_lies, f"{e.label}every lifecycle 200 truthful ({len(real_lies)} of {checked} not; known core "
              "bugs aside)", shown)  # fmt: skip
        check(e.settle is None, f"{e.label}proxy state == engine state after a quiet settle ({e.settle or 'agreed'})")
        check(e.recovered, f"{e.label}recovered to RUNNING through the proxy")
        check(e.leftover is not None and e.leftover["held_requests"] == 0 and e.leftover["inflight_requests"] == 0,
              f"{e.label}nothing held or in flight at the end (no leaked admission tickets)")  # fmt: skip
        if not several:
            not_fired = [k for k in kinds if journal.faults_fired.get(k, 0) == 0]
            check(not not_fired, f"every fault kind fired ({', '.join(not_fired) or 'all ' + str(len(kinds))})")
    if several:
        # Coverage of the run, not of each engine: an engine swapped out or down for much of a bounded run leaves
        # some kinds unfired on it (each safety invariant above still holds per engine).
        fired_on = {k: [e.name for e in engines if journals[e.name].faults_fired.get(k, 0)] for k in kinds}
        not_fired = [k for k in kinds if not fired_on[k]]
        spread = ", ".join(f"{k} on {'+'.join(names)}" for k, names in fired_on.items() if names)
        check(not not_fired, f"every fault kind fired on some engine ({', '.join(not_fired) or spread})")
    check(
        final_ok == 10, f"{final_ok}/10 requests 200 after the recovery" + (" (the models in turn)" if several else "")
    )
    check(
        all(rc == 0 for rc in proxy_rcs), f"SIGTERM: the proxy exited 0 (exit status {', '.join(map(str, proxy_rcs))})"
    )
    if several:
        busy = [c for c in tally.calls if c.reason == "insufficient_gpu_memory" and
                not any(reason in c.detail for reason in ROOM_REFUSALS)]  # fmt: skip
        check(not busy, f"0 requests refused because a neighbour was busy ({len(busy)}): they wait their turn "
              "(a wake is refused only for a neighbour that cannot sleep now, or memory none holds)",
              show(busy))  # fmt: skip
        check(peak >= 0 and not over, f"never more awake than fits: the device's use at every memory move of every "
              f"engine <= its total (peak {peak / GIB:.1f} of {total / GIB:.1f} GiB; {len(over)} moves over)",
              [f"{m.engine} at {m.t:.3f}: own {m.own / GIB:.1f} GiB, device {m.device / GIB:.1f} GiB"
               for m in over])  # fmt: skip
    if args.pods > 1:
        check(not overlaps, f"never two wakes overlapping on one GPU across pods ({len(overlaps)} overlaps in "
              f"{sum(len(w) for w in wakes.values())} wakes)", overlaps)  # fmt: skip
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
        "faults_fired": {e.name: dict(journals[e.name].faults_fired) for e in engines},
        "restarts": sum(e.sim.restarts for e in engines), "truth_checked": sum(t[0] for t in truth.values()),
        "violations": sum(len(j.violations) for j in journals.values()), "known_bugs": dict(known),
        "broken": broken, "proxy_restarts": len(downtimes), "cut_by_proxy_restart": dict(cut_kinds),
    }  # fmt: skip
    if several:
        summary.update({"engines": len(engines), "swaps": dict(swaps), "device_peak_bytes": peak,
                        "device_total_bytes": total, "memory_moves": len(moves)})  # fmt: skip
    if args.pods > 1:
        summary.update({"pods": args.pods, "wakes": sum(len(w) for w in wakes.values()),
                        "overlapping_wakes": len(overlaps)})  # fmt: skip
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    verdict = "PASS" if not broken else "FAIL: " + "; ".join(broken)
    print(f"\nchaos: {verdict} (seed {args.seed}; logs and summary in {workdir})")
    for line in first_calls:
        print(f"  broken: {line}")
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
    parser.add_argument("--engines", type=int, default=int(os.environ.get("CHAOS_ENGINES", 1)),
                        help="several engines (2: a and b) on one simulated GPU that fits one awake, behind one "
                        "proxy with engines:; clients ask for every model at random (swaps), trainers call "
                        "/engines/<name>/...; no proxy restarts in this mode")  # fmt: skip
    parser.add_argument("--pods", type=int, default=int(os.environ.get("CHAOS_PODS", 1)),
                        help="several pods (2 or 3: a, b, c) on one simulated GPU that fits one awake, each a "
                        "simulator and its own proxy, all proxies on one gpu_lock_dir; proxy restarts per pod "
                        "(make chaos-pods)")  # fmt: skip
    parser.add_argument("--strict", action="store_true", default=os.environ.get("CHAOS_STRICT") == "1",
                        help="count the known core bugs (KNOWN_BUGS) as broken invariants too")  # fmt: skip
    args = parser.parse_args(argv)
    args.require_targets = not args.quick
    if args.engines > 1 and args.pods > 1:
        parser.error("--engines and --pods are two modes: one proxy of several engines, or one proxy per pod")
    if args.engines > 1:
        args.proxy_restarts = False  # left out of this mode: the single-engine run restarts the proxy
    if args.quick and "--duration" not in (argv if argv is not None else sys.argv[1:]):
        # Two engines on one GPU: each is swapped out (or failed, and nothing can be woken beside it) much of
        # the time, and 75 s did not see every fault kind fire on each (seeds 7 and 11, 2026-12-03).
        args.duration = float(os.environ.get("CHAOS_DURATION", 110 if max(args.engines, args.pods) > 1 else 75))
    return run_in_workdir(args, "lifeguard-chaos-", run)


def run_in_workdir(
    args: argparse.Namespace, prefix: str, run: Callable[[argparse.Namespace, Path], Awaitable[int]]
) -> int:
    """`run(args, workdir)` in --workdir, or a fresh temporary folder that a pass removes unless --keep."""
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    rc = asyncio.run(run(args, workdir))
    if rc == 0 and not args.keep and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
