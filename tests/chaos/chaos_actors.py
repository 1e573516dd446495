"""The chaos run's actors: clients, trainers, the fault injector, the healer, and the simulator's supervisor.

Each actor records every exchange as a `Call`; pacing uses short bounded sleeps (this is load, not a
test waiting on a condition). Every HTTP call has a client-side deadline, so nothing here can hang.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from lifeguard_sim.memory import GpuMemory
from lifeguard_sim.shared_gpu import SharedGpuFile
from tests.chaos.chaos_checks import Call, error_shape_problem, journal_entries

SIM_SCRIPT = Path(__file__).with_name("sim_process.py")

PROMPTS = ("The capital of France is", "Once upon a time", "def fib(n):", "Roses are red", "hello")
# Served model name -> engine name ("": the one engine of the single-engine run).
ONE_MODEL = {"tiny": ""}
# With several engines on one GPU (--engines N): each takes 50 GiB awake and 2 asleep of an 80 GiB device,
# so only one fits awake (tests/e2e/conftest.py BIG).
SHARED_SIZES = {"weights_gib": 16.0, "kv_gib": 32.0, "overhead_gib": 2.0, "total_gib": 80.0}
SHARED_AWAKE_BYTES = GpuMemory(**SHARED_SIZES).used_bytes


async def wait_for_200(session: aiohttp.ClientSession, url: str, timeout: float, failure: str) -> None:
    """Poll `url` until it answers 200 (a process that is starting refuses or times out meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{failure}: no 200 within {timeout} s")


@dataclass
class Tally:
    """Everything the actors recorded."""

    calls: list[Call] = field(default_factory=list)
    faults_injected: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    ended: int = 0


# ----- the simulator process and its restarter
class SimSupervisor:
    """Runs sim_process.py; restarts it whenever it exits (a crash, the lie-dead watchdog, or our kill).

    `name` (several engines on one GPU): the simulator serves `model-<name>` and shares `gpu.json` with the
    others, its use under `name` (SHARED_SIZES). A start then first claims its memory on the device, as
    vLLM allocates at startup; with no room (another engine awake) it waits and tries again, as vLLM fails
    its startup check of free memory and is restarted until there is room. When the process exits its memory
    is given back (the driver frees a dead process's memory)."""

    def __init__(self, port: int, workdir: Path, seed: int, name: str = "") -> None:
        self.port = port
        self.name = name
        self.model = f"model-{name}" if name else "tiny"
        prefix = f"sim-{name}" if name else "sim"
        self.journal = workdir / f"{prefix}-journal.jsonl"
        self.gpu_file = workdir / "gpu.json"
        self._log = open(workdir / f"{prefix}.log", "ab")  # noqa: SIM115 - lives as long as the supervisor
        self._seed = seed
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started_at = 0.0
        self._stopping = False
        self.waits_for_room = 0  # restarts that waited for another engine to free the device
        self._waiting = False
        self._shared = SharedGpuFile(self.gpu_file, name, int(SHARED_SIZES["total_gib"] * (1 << 30))) if name else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def waiting_for_room(self) -> bool:
        return self._waiting

    def start(self) -> bool:
        """Start the simulator; False when it must wait for room on the shared device (then try again)."""
        if self._shared is not None and not self._claim_room():
            self.waits_for_room += not self._waiting
            self._waiting = True
            return False
        self._waiting = False
        self._seed += 1
        args = [
            sys.executable, str(SIM_SCRIPT), "--journal", str(self.journal), "--port", str(self.port),
            "--gpu-file", str(self.gpu_file), "--sleep-seconds", "0.02", "--wake-seconds", "0.03",
            "--token-seconds", "0.002", "--watchdog-seconds", "1.0", "--seed", str(self._seed),
            "--log-level", "error",
        ]  # fmt: skip
        if self.name:
            args += ["--gpu-file-engine", self.name, "--model", self.model]
            args += [arg for key, value in SHARED_SIZES.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started_at = time.monotonic()
        return True

    def _claim_room(self) -> bool:
        """Take this engine's awake memory on the shared device if the others leave room (journalled as the
        simulator journals its own memory moves)."""
        assert self._shared is not None
        own = GpuMemory(**SHARED_SIZES).snapshot()
        device = self._shared.claim(own)
        if device is not None:
            self._journal_memory("start", SHARED_AWAKE_BYTES, device)
        return device is not None

    def _journal_memory(self, why: str, own: int, device: int) -> None:
        total = int(SHARED_SIZES["total_gib"] * (1 << 30))
        self._journal_line({"t": time.time(), "ev": "memory", "why": why, "own": own, "device": device, "total": total})

    def _journal_line(self, entry: dict[str, Any]) -> None:
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.close(fd)

    def kill(self) -> bool:
        """What an operator's liveness probe does to a hung or wedged vLLM; False if none was running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            return True
        return False

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout: float = 20.0) -> None:
        await wait_for_200(session, self.url + "/health", timeout, "the simulator did not become healthy (see sim.log)")

    async def restarter(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.proc is not None and self.proc.poll() is not None and not self._stopping:
                dead = {"executor_tags": [], "scheduling_asleep": False, "sleep_level": None, "paused": False,
                        "is_sleeping": False, "weight_update_active": False, "weights_valid": False,
                        "dead": True, "garbage": False}  # fmt: skip
                self._journal_line({"t": time.time(), "ev": "state", "why": "exited", "s": dead})
                if self._shared is not None:  # the driver frees a dead process's memory
                    gone = {**GpuMemory(**SHARED_SIZES).snapshot(), "used_bytes": 0}
                    self._journal_memory("exited", 0, self._shared.publish(gone))
                self.restarts += 1
                self.proc = None
            if self.proc is None and not self._stopping:
                self.start()
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


# ----- one exchange, classified
def _outcome_for_error(call: Call, status: int, headers: Any, body: bytes) -> None:
    call.status = status
    call.reason = headers.get("X-Lifeguard-Reason")
    problem = error_shape_problem(status, headers, body)
    call.outcome = "bad_error_shape" if problem else "proxy_error"
    call.detail = problem or _message(body)


async def inference(session: aiohttp.ClientSession, base: str, rng: random.Random, tally: Tally,
                    deadline_s: float, models: dict[str, str] = ONE_MODEL) -> Call:  # fmt: skip
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    early = rng.random() < 0.08
    prompt = rng.choice(PROMPTS)
    model = rng.choice(list(models)) if len(models) > 1 else next(iter(models))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 16), "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    call = Call("inference", time.time(), engine=models[model])
    tally.calls.append(call)
    tally.sent += 1
    try:
        async with asyncio.timeout(deadline_s):
            if early and not stream:
                try:
                    async with asyncio.timeout(rng.uniform(0.001, 0.05)):
                        await _exchange(session, url, body, call, early=False)
                except TimeoutError:
                    call.outcome = "client_gone"
            else:
                await _exchange(session, url, body, call, early=early)
    except TimeoutError:
        call.outcome = "hang"
    except aiohttp.ClientPayloadError as exc:
        call.outcome, call.detail = "dropped_mid_response", repr(exc)
    except (aiohttp.ClientError, OSError) as exc:
        call.outcome, call.detail = "no_answer", repr(exc)
    finally:
        call.t_end = time.time()
        tally.ended += 1
    return call


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict[str, Any], call: Call, *, early: bool) -> None:
    async with session.post(url, json=body) as resp:
        call.status = resp.status
        if resp.headers.get("X-Lifeguard-Reason"):
            _outcome_for_error(call, resp.status, resp.headers, await resp.read())
            return
        if resp.status != 200:
            raw = await resp.read()
            try:
                json.loads(raw)
                call.outcome = "upstream_status"
            except ValueError:
                call.outcome, call.detail = "unexplained", f"{resp.status} {raw[:120]!r}"
            return
        if not body["stream"]:
            raw = await resp.read()
            try:
                call.outcome = "ok" if "choices" in json.loads(raw) else "unexplained"
            except ValueError:
                call.outcome, call.detail = "unexplained", repr(raw[:120])
            return
        if early:
            await resp.content.readany()
            resp.close()
            call.outcome = "client_gone"
            return
        data = b""
        while chunk := await resp.content.readany():
            data += chunk
        if b"data: [DONE]" in data:
            call.outcome = "ok"
        elif b'"error"' in data:
            call.outcome = "stream_error_event"
        else:
            call.outcome, call.detail = "truncated", repr(data[-200:])


async def client(session: aiohttp.ClientSession, base: str, seed: int, tally: Tally, stop: asyncio.Event,
                 deadline_s: float, models: dict[str, str] = ONE_MODEL) -> None:  # fmt: skip
    """`models`: the served names it picks from at random, each with its engine (several: swaps)."""
    rng = random.Random(seed)
    while not stop.is_set():
        call = await inference(session, base, rng, tally, deadline_s, models)
        # A real client honours Retry-After loosely; without a pause the run is mostly instant 503s.
        # A refused connection (the proxy restarting) is backed off the same way.
        backoff = call.status == 503 or call.outcome == "no_answer"
        await asyncio.sleep(rng.uniform(0.1, 0.4) if backoff else rng.uniform(0, 0.02))


# ----- trainers
def _random_call(rng: random.Random) -> tuple[str, list[tuple[str, str]], Any]:
    op = rng.choices(
        ["sleep", "wake_up", "pause", "resume", "session", "update_weights", "finish_weight_update",
         "start_weight_update", "collective_rpc"],
        weights=[16, 20, 12, 12, 8, 3, 3, 3, 10],
    )[0]  # fmt: skip
    query: list[tuple[str, str]] = []
    body: Any = None
    if op == "sleep":
        query = [("level", str(rng.choice([0, 1, 1, 1, 2]))), ("mode", rng.choice(["abort", "wait", "keep"]))]
    elif op == "wake_up":
        tags = rng.choice([None, None, ["weights"], ["kv_cache"], ["weights", "kv_cache"], ["scheduling"]])
        if tags and rng.random() < 0.5:
            query = [("tags", ",".join(tags))]
        elif tags:
            query = [("tags", t) for t in tags]
    elif op == "pause":
        query = [("mode", rng.choice(["abort", "wait", "keep"]))]
        if rng.random() < 0.2:
            query.append(("clear_cache", rng.choice(["true", "false"])))
    elif op == "update_weights":
        body = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
    elif op == "finish_weight_update" and rng.random() < 0.5:
        body = {"weight_version": f"v{rng.randint(1, 999)}"}
    elif op == "collective_rpc":
        body = {"method": "reload_weights"}
    return op, query, body


async def lifecycle_call(session: aiohttp.ClientSession, base: str, op: str, query: list[tuple[str, str]],
                         body: Any, tally: Tally, deadline_s: float, engine: str = "") -> Call:  # fmt: skip
    """`base`: the proxy, or with several engines one engine's base URL (/engines/<engine>)."""
    call = Call(op, time.time(), query, engine=engine)
    tally.calls.append(call)
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(base + "/" + op, params=query, json=body) as resp:
                raw = await resp.read()
                call.status = resp.status
                call.noop = resp.headers.get("X-Lifeguard-Noop") == "true"
                call.deferred = "X-Lifeguard-Deferred" in resp.headers
                if resp.headers.get("X-Lifeguard-Reason"):
                    _outcome_for_error(call, resp.status, resp.headers, raw)
                elif 200 <= resp.status < 300:
                    call.outcome = "noop" if call.noop else "ok"
                else:
                    call.outcome, call.detail = "unexplained", f"{resp.status} {raw[:120]!r}"
    except TimeoutError:
        call.outcome = "hang"
    except (aiohttp.ClientError, OSError) as exc:
        call.outcome, call.detail = "no_answer", repr(exc)
    finally:
        call.t_end = time.time()
    return call


async def trainer(session: aiohttp.ClientSession, base: str, seed: int, tally: Tally, stop: asyncio.Event,
                  deadline_s: float, engine: str = "") -> None:  # fmt: skip
    rng = random.Random(seed)
    send = functools.partial(lifecycle_call, engine=engine)
    while not stop.is_set():
        op, query, body = _random_call(rng)
        if op == "session":  # a whole weight-update session, as a trainer runs it
            first = await send(session, base, "start_weight_update", [], None, tally, deadline_s)
            if first.status == 200:
                for _ in range(rng.randint(1, 3)):
                    update = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
                    await send(session, base, "update_weights", [], update, tally, deadline_s)
            if first.status == 200 or first.outcome == "no_answer":  # a start cut by a restart may have opened it
                await _finish(functools.partial(send, session, base), rng, tally, stop, deadline_s)
        elif rng.random() < 0.1:  # the same call twice at once: the second joins the first
            await asyncio.gather(
                send(session, base, op, query, body, tally, deadline_s),
                send(session, base, op, query, body, tally, deadline_s),
            )
        else:
            await send(session, base, op, query, body, tally, deadline_s)
        await asyncio.sleep(rng.uniform(0.02, 0.3))


async def _finish(send: Callable[..., Any], rng: random.Random, tally: Tally, stop: asyncio.Event,
                  deadline_s: float) -> None:  # fmt: skip
    """The session's finish, sent again while a proxy restart cuts it (a connection error), as a trainer ends its own
    session: left open, a restarted proxy holds it (inference held, every lifecycle call refused, the GPU kept from
    the other pods) until some later finish, 20 s in seed 399 of make chaos-pods."""
    for _ in range(10):
        finish = await send("finish_weight_update", [], None, tally, deadline_s)
        if finish.outcome != "no_answer" or stop.is_set():
            return
        await asyncio.sleep(rng.uniform(0.2, 0.5))


# ----- faults
GENERAL_OPS = ("sleep", "wake_up", "pause", "resume", "start_weight_update", "update_weights",
               "finish_weight_update", "collective_rpc", "generate")  # fmt: skip
# lie-asleep only where vLLM has a flag that can catch it (a weight-update lie cannot be seen from outside).
FAULT_OPS: dict[str, tuple[str, ...]] = {
    "error500": GENERAL_OPS,
    "wedge": GENERAL_OPS,
    "crash": GENERAL_OPS,
    "hang": GENERAL_OPS,
    "lie-asleep": ("sleep", "wake_up", "pause", "resume"),
    "lie-memory": ("sleep", "wake_up"),
    # a wake that restores other weights: caught by the weights' checksums. Not on collective_rpc: the trainers'
    # reloads are rare, an armed fault that does not fire is tried again at once, and it starved the other kinds
    # (seed 42: lie-dead never armed in the bounded run).
    # a level-1 sleep or a wake: a forwarded wake alone (an asleep engine, within the wait) left it unfired (seed 42)
    "lie-weights": ("sleep", "wake_up"),
    "lie-dead": GENERAL_OPS,
    "garbage": GENERAL_OPS,
    "slow": GENERAL_OPS,
}
OFTEN = {"generate": 3, "sleep": 4, "wake_up": 4, "pause": 2, "resume": 2}


LETHAL = frozenset({"crash", "hang", "lie-dead", "wedge"})


class FaultLine:
    """Which faults to arm next: every kind once per turn of the line (shuffled), two at a time on different
    operations, the kinds not yet seen to fire first in each turn. A kind armed and not fired waits for the next
    turn: retried at once, it was armed round after round while the others waited (CI, seed 9199 of chaos-pods:
    lie-dead armed 26 times, slow twice and never fired, in the 110 s run)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._line: list[str] = []  # popped from the end
        self.fired: set[str] = set()

    def next_round(self, asleep: bool | None = None) -> dict[str, str]:
        """kind -> the operation to arm it on. `asleep` (the engine's weights asleep now; None: not known): a kind armed
        only on a sleep or a wake (lie-memory, lie-weights) is armed on the one that can come next, a wake of an engine
        asleep, a sleep of one awake: armed the other way it waited out its round unfired, most rounds on an engine
        that sleeps two turns of three (make chaos-pods seed 42: lie-memory armed 11 times, fired on no engine)."""
        chosen: dict[str, str] = {}
        while len(chosen) < 2:
            if not self._line:
                self._line = list(FAULT_OPS)
                self._rng.shuffle(self._line)
                self._line.sort(key=lambda kind: kind not in self.fired)  # stable: the unfired at the end, first
            kind = self._line.pop()
            ops = [o for o in FAULT_OPS[kind] if o not in chosen.values()]
            if asleep is not None and set(FAULT_OPS[kind]) == {"sleep", "wake_up"}:
                ops = [o for o in ops if o == ("wake_up" if asleep else "sleep")]
            if not ops:
                continue  # its operations are armed already this round: back at the next shuffle
            chosen[kind] = self._rng.choices(ops, weights=[OFTEN.get(o, 1) for o in ops])[0]
            if kind in LETHAL:
                break  # a lethal fault wipes whatever else is armed
        return chosen

    def not_armed(self, chosen: dict[str, str]) -> None:
        """The simulator could not be told (it was down): these are next again."""
        self._line.extend(chosen)

    def tried(self, chosen: dict[str, str], unfired: set[str]) -> set[str]:
        """The kinds of `chosen` that fired."""
        fired = set(chosen) - unfired
        self.fired |= fired
        return fired


async def fault_injector(session: aiohttp.ClientSession, sim: SimSupervisor, seed: int, tally: Tally,
                         stop: asyncio.Event) -> None:  # fmt: skip
    """Arms the faults `FaultLine` chooses; waits for them to fire, then plays the operator for the kinds only
    a restart clears (hang, wedge)."""
    rng = random.Random(seed)
    line = FaultLine(rng)
    # The last round's: where its faults' journal starts, and the process they were armed in.
    journal_mark = 0
    round_pid: int | None = None
    while not stop.is_set():
        state = await sim_state(session, sim)
        chosen = line.next_round(asleep=None if state is None else "weights" in state["asleep_tags"])
        specs = [f"{op}:slow:{rng.uniform(0.2, 1.5):.2f}" if kind == "slow" else f"{op}:{kind}"
                 for kind, op in chosen.items()]  # fmt: skip
        journal_mark = sim.journal.stat().st_size if sim.journal.exists() else 0
        round_pid = sim.proc.pid if sim.proc else None
        if not await _set_faults(session, sim, specs):
            line.not_armed(chosen)
            await asyncio.sleep(0.2)
            continue
        tally.faults_injected.update(chosen.keys())
        unfired, died = await _wait_fired(session, sim, stop, set(chosen), journal_mark, timeout=6.0)
        if not died and {"hang", "wedge"} & line.tried(chosen, unfired):
            await _sleep_unless(stop, rng.uniform(1.0, 2.5))
            _operator_restart(sim, tally, set(chosen))
            round_pid = None  # restarted: nothing of this round is left for the end
        if unfired:
            await _set_faults(session, sim, [])
        await _sleep_unless(stop, rng.uniform(0.2, 1.0))
    await _set_faults(session, sim, [])
    # The round the end of the chaos phase cut short: a hang or a wedge that fired before its faults were cleared
    # is cleared only by a restart, and the operator's still comes (seed 207: a finish_weight_update wedged as the
    # phase ended left every recovery of that pod's session failing, and its engine awake, taking the others' room).
    if round_pid is not None and sim.proc is not None and sim.proc.pid == round_pid and sim.proc.poll() is None:
        lethal = {"hang", "wedge"} & _fired_since(sim.journal, journal_mark)
        if lethal:
            _operator_restart(sim, tally, lethal)


def _operator_restart(sim: SimSupervisor, tally: Tally, kinds: set[str]) -> None:
    """The liveness probe's restart of a vLLM that a hang or a wedge (among `kinds`) left unusable."""
    sim.kill()
    tally.kills["hang" if "hang" in kinds else "wedge"] += 1


async def _set_faults(session: aiohttp.ClientSession, sim: SimSupervisor, specs: list[str]) -> bool:
    try:
        async with session.post(sim.url + "/sim/faults", json=specs, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _wait_fired(session: aiohttp.ClientSession, sim: SimSupervisor, stop: asyncio.Event,
                      armed: set[str], journal_mark: int, timeout: float) -> tuple[set[str], bool]:  # fmt: skip
    """The kinds still armed when every fault fired, the process died or time ran out; and whether it died.
    A process that died (of a lethal fault, or killed by the healer) takes its armed faults with it: the
    ones its journal does not show fired since `journal_mark` are still to be tried."""
    deadline = time.monotonic() + timeout
    pid = sim.proc.pid if sim.proc else None
    while time.monotonic() < deadline and not stop.is_set():
        if sim.proc is None or sim.proc.pid != pid or sim.proc.poll() is not None:
            return armed - _fired_since(sim.journal, journal_mark), True
        try:
            async with session.get(sim.url + "/sim/faults", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    armed = {str(f["kind"]) for f in await resp.json()}
                    if not armed:
                        return armed, False
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    return armed, False


def _fired_since(journal: Path, offset: int) -> set[str]:
    return {str(e["kind"]) for e in journal_entries(journal, offset) if e.get("ev") == "fault"}


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


async def healer(session: aiohttp.ClientSession, base: str, sim: SimSupervisor, tally: Tally,
                 stop: asyncio.Event, failed_for_s: float = 3.0,
                 neighbours: tuple[tuple[str, str], ...] = ()) -> None:  # fmt: skip
    """A FAILED engine that stays FAILED (garbage, memory not back) is one an operator restarts.

    `neighbours` (several engines on one GPU: (name, base URL) of each other engine): an engine whose restart
    has waited `failed_for_s` for room (another engine awake) is one an operator makes room for, putting the
    others to sleep through the proxy, as the recovery does. Nothing else frees the room: a request for a
    dead engine wakes nothing (seed 11: an engine stayed down 43 s of 110, and no fault could fire on it)."""
    failed_since: float | None = None
    waiting_since: float | None = None
    while not stop.is_set():
        now = time.monotonic()
        if neighbours and sim.waiting_for_room:
            waiting_since = waiting_since or now
            if now - waiting_since > failed_for_s:
                tally.kills["room_made"] += 1
                for name, other in neighbours:
                    await lifecycle_call(session, other, "sleep", [("level", "1")], None, tally, 10.0, name)
                waiting_since = None
        else:
            waiting_since = None
        state = await proxy_state(session, base)
        now = time.monotonic()
        if state is not None and state["state"] == "FAILED":
            failed_since = failed_since or now
            if now - failed_since > failed_for_s and now - sim.started_at > failed_for_s:
                tally.kills["healer"] += sim.kill()
                failed_since = None
        else:
            failed_since = None
        await _sleep_unless(stop, 0.25)


async def orchestrator(session: aiohttp.ClientSession, engines: list[tuple[str, str]], seed: int, tally: Tally,
                       stop: asyncio.Event, deadline_s: float,
                       every_s: tuple[float, float] = (2.0, 5.0)) -> None:  # fmt: skip
    """Several pods on one GPU (--pods): the time-slicing orchestrator (rl-time-slicing's Yield and Acquire, a
    trainer's). Every few seconds the next engine in turn gets the GPU: the others that are awake are put to
    sleep through their own pods' proxies (only its pod may do that), then it is woken through its own. Each
    wake is admitted against the device's memory under the node's lock, and races the wakes the other pods'
    requests and trainers ask for; the turn bounds how long an engine sleeps (a request vLLM queued when it
    fell asleep runs only after its wake). `engines`: (name, base URL) of each."""
    rng = random.Random(seed)
    turn = 0
    while not stop.is_set():
        await _sleep_unless(stop, rng.uniform(*every_s))
        chosen = engines[turn % len(engines)]
        turn += 1
        for name, base in engines:
            if stop.is_set():
                return
            state = await proxy_state(session, base)
            # Paused, it holds its memory too (a /sleep from PAUSED is allowed).
            if (name, base) != chosen and state is not None and state["state"] in ("RUNNING", "PAUSED"):
                tally.kills["orchestrator_sleep"] += 1
                await lifecycle_call(session, base, "sleep", [("level", "1")], None, tally, deadline_s, name)
        if not stop.is_set():
            tally.kills["orchestrator_wake"] += 1
            await lifecycle_call(session, chosen[1], "wake_up", [], None, tally, deadline_s, chosen[0])


async def proxy_state(session: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
    try:
        async with session.get(base + "/lifeguard/state", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            body: dict[str, Any] = await resp.json()
            return body
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def sim_state(session: aiohttp.ClientSession, sim: SimSupervisor) -> dict[str, Any] | None:
    try:
        async with session.get(sim.url + "/sim/state", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            body: dict[str, Any] = await resp.json()
            return body
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def each(tally: Tally, predicate: Callable[[Call], bool]) -> list[Call]:
    return [c for c in tally.calls if predicate(c)]


def _message(body: bytes) -> str:
    """The message of an error in vLLM's shape (the proxy's own errors have it), else nothing."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""
