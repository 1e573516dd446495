"""The chaos run's records and invariants: pure functions over what the actors recorded and the sim's journal.

Nothing here does I/O except reading the journal file; `chaos_run` prints what `Findings` holds.
"""

from __future__ import annotations

import bisect
import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MEMORY_TAGS = frozenset({"weights", "kv_cache"})

# Every way a client request may end that keeps the promise, and those that break it.
GOOD_INFERENCE = frozenset({"ok", "stream_error_event", "upstream_status", "proxy_error", "client_gone"})
BAD_INFERENCE = frozenset({"hang", "no_answer", "dropped_mid_response", "truncated", "unexplained", "bad_error_shape"})


@dataclass
class Call:
    """One HTTP exchange a client or trainer made, and how it ended."""

    kind: str  # "inference" or a lifecycle op name
    t_send: float
    query: list[tuple[str, str]] = field(default_factory=list)
    t_end: float = 0.0
    status: int | None = None
    outcome: str = "pending"
    reason: str | None = None
    noop: bool = False
    deferred: bool = False
    detail: str = ""
    engine: str = ""  # with several engines (--engines N): the engine it was for; "" with one


def error_shape_problem(status: int, headers: Any, body: bytes) -> str | None:
    """What is wrong with an error the proxy made (it carries X-Lifeguard-Reason), or None."""
    if status == 500:
        return "the proxy answered 500"
    if status >= 500 and status != 503:
        return f"the proxy answered {status} (only 503 is allowed among 5xx)"
    if status == 503 and not headers.get("Retry-After"):
        return "a proxy 503 without Retry-After"
    try:
        payload = json.loads(body)
        err = payload["error"]
        if not {"message", "type", "param", "code"} <= set(err):
            return f"error envelope lacks fields: {sorted(err)}"
    except (ValueError, KeyError, TypeError):
        return f"error body is not vLLM's JSON envelope: {body[:120]!r}"
    return None


# ----- the simulator's journal
@dataclass
class Journal:
    timeline: list[tuple[float, dict[str, Any]]]
    violations: list[dict[str, Any]]
    faults_fired: Counter[str]
    deaths: list[str]
    starts: int
    # (pid, op, began, ended) of every pause and sleep the engine ran
    pausing: list[tuple[int, str, float, float]] = field(default_factory=list)
    # On a shared GPU file: every write of this engine's use, and the wakes the device refused for want of room.
    memory: list[MemoryMove] = field(default_factory=list)
    ooms: int = 0
    # Every wake the engine ran, from its start to its end (or the process's death), in journal order.
    wakes: list[WakeSpan] = field(default_factory=list)


@dataclass(frozen=True)
class WakeSpan:
    """One /wake_up the simulator ran: `hung` when a hang fault held it before any memory was mapped (it never
    allocates: the proxy's call times out and lets the GPU go, as it must)."""

    engine: str
    began: float
    ended: float
    pid: int | None
    hung: bool = False


@dataclass(frozen=True)
class MemoryMove:
    """One write of an engine's use to the shared GPU file: the device's sum it wrote under the file's lock."""

    t: float
    engine: str
    own: int
    device: int
    total: int


def journal_entries(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The journal's entries from byte `offset` on; none if the simulator never wrote one."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill -9 mid-write
    return entries


def read_journal(path: Path, engine: str = "") -> Journal:
    timeline: list[tuple[float, dict[str, Any]]] = []
    violations: list[dict[str, Any]] = []
    fired: Counter[str] = Counter()
    deaths: list[str] = []
    starts = 0
    open_ops: dict[tuple[int, str], list[float]] = {}
    pausing: list[tuple[int, str, float, float]] = []
    memory: list[MemoryMove] = []
    ooms = 0
    wakes: list[WakeSpan] = []
    open_wakes: dict[int | None, tuple[float, bool]] = {}  # by pid: began, hung

    def end_wakes(t: float, pid: int | None = None, *, every: bool = False) -> None:
        for key in [k for k in open_wakes if every or k == pid]:
            began, hung = open_wakes.pop(key)
            wakes.append(WakeSpan(engine, began, t, key, hung))

    def end_pausing(t: float, pid: int | None = None, *, every: bool = False) -> None:
        """A pause or sleep the process's death cut: it ran until then (seed 399 of the chaos run: a crash 6 ms into
        a /pause, and 15 requests the gate had let through just before it arrived in transit, never run)."""
        for p, op in [key for key in open_ops if key[1] in ("pause", "sleep") and (every or key[0] == pid)]:
            pausing.extend((p, op, began, t) for began in open_ops.pop((p, op)))

    for entry in journal_entries(path):
        ev = entry.get("ev")
        t, pid = float(entry["t"]), entry.get("pid")
        if ev == "begin" and entry.get("op") == "wake_up":
            open_wakes[pid] = (t, False)
        elif ev == "fault" and entry.get("op") == "wake_up" and entry.get("kind") == "hang" and pid in open_wakes:
            open_wakes[pid] = (open_wakes[pid][0], True)
        elif ev == "state" and str(entry.get("why", "")).startswith("wake_up:"):
            end_wakes(t, pid)
        elif ev == "die" or (ev == "state" and entry.get("why") == "exited"):
            end_wakes(t, pid, every=entry.get("why") == "exited")  # the supervisor's line: whatever ran ended
            end_pausing(t, pid, every=entry.get("why") == "exited")
        if ev == "begin":
            open_ops.setdefault((entry["pid"], entry["op"]), []).append(float(entry["t"]))
        if ev == "state" and str(entry.get("why", "")).split(":")[0] in ("pause", "sleep"):
            began = open_ops.get((entry["pid"], entry["why"].split(":")[0])) or [float(entry["t"])]
            pausing.append((entry["pid"], entry["why"].split(":")[0], began.pop(0), float(entry["t"])))
        if ev == "state" and "s" in entry:
            timeline.append((float(entry["t"]), entry["s"]))
            starts += entry.get("why") == "start"
        elif ev == "die":
            timeline.append((float(entry["t"]), entry["s"]))
            deaths.append(str(entry.get("reason")))
        elif ev == "violation":
            violations.append({**entry["violation"], "pid": entry.get("pid")})
        elif ev == "fault":
            fired[str(entry["kind"])] += 1
        elif ev == "memory":
            memory.append(MemoryMove(float(entry["t"]), engine, int(entry["own"]), int(entry["device"]),
                                     int(entry["total"])))  # fmt: skip
        elif ev == "oom":
            ooms += 1
    timeline.sort(key=lambda item: item[0])
    if open_wakes:
        end_wakes(float("inf"), every=True)  # still waking when the run ended
    return Journal(timeline, violations, fired, deaths, starts, pausing, memory, ooms, wakes)


def states_during(timeline: list[tuple[float, dict[str, Any]]], start: float, end: float,
                  times: list[float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The engine states in effect at some moment of [start, end]; `times`: the timeline's, when the caller asks
    for many windows of one timeline (an hour's soak has tens of thousands)."""
    times = times if times is not None else [t for t, _ in timeline]
    first = max(bisect.bisect_right(times, start) - 1, 0)
    last = bisect.bisect_right(times, end)
    return [s for _, s in timeline[first:last]]


def _tags(query: list[tuple[str, str]]) -> set[str] | None:
    raw = [v for k, v in query if k == "tags"]
    if not raw:
        return None
    return {t.strip() for v in raw for t in v.split(",") if t.strip()}


def claim_holds(call: Call, s: dict[str, Any]) -> bool:
    """Whether engine state `s` is what a 200 for `call` promised."""
    executor = set(s["executor_tags"])
    op = call.kind
    if op in ("start_weight_update", "update_weights", "finish_weight_update", "collective_rpc"):
        # vLLM has no flag for these; the proxy forwards vLLM's answer (see docs/reliability.md).
        if op == "start_weight_update":
            return bool(s["weight_update_active"])
        if op == "finish_weight_update":
            return not s["weight_update_active"]
        return "weights" not in executor
    if s["dead"]:
        return False
    if op == "sleep":
        level = int(dict(call.query).get("level", "1"))
        if call.noop:  # the issue-2 table: already asleep at that level (also after a partial wake, as vLLM)
            if level == 0:  # EngineCore.sleep(0) is pause_scheduler() and nothing else: a paused engine is it
                return bool(s["paused"]) and not executor
            return bool(s["is_sleeping"]) and s["sleep_level"] == level
        return bool(s["is_sleeping"]) if level == 0 else executor == MEMORY_TAGS
    if op == "wake_up":
        tags = _tags(call.query)
        if tags is None:
            return not executor and not s["scheduling_asleep"]
        return not (tags & MEMORY_TAGS & executor)
    if op == "pause":
        return bool(s["is_sleeping"]) if call.deferred else bool(s["paused"])
    if op == "resume":
        return not s["paused"] and not executor
    return True


def died_within(timeline: list[tuple[float, dict[str, Any]]], start: float, end: float) -> bool:
    """Whether the engine died between `start` and `end`, whether or not a restarted one answers by then (a
    restarted vLLM looks awake: until the next reconcile round the proxy's belief is the dead one's)."""
    return any(s["dead"] and start <= t <= end for t, s in timeline)


def untruthful(calls: list[Call], timeline: list[tuple[float, dict[str, Any]]]) -> tuple[int, list[tuple[Call, str]]]:
    """(how many lifecycle 200s were checked, [(call, known bug or ""), ...] for those no engine state in
    their window supports)."""
    checked = 0
    bad: list[tuple[Call, str]] = []
    times = [t for t, _ in timeline]
    for call in calls:
        if call.kind == "inference" or call.status != 200:
            continue
        checked += 1
        window = states_during(timeline, call.t_send, call.t_end, times)
        if not any(claim_holds(call, s) for s in window):
            shown = [{k: s[k] for k in ("executor_tags", "paused", "weight_update_active", "dead")} for s in window]
            at = time.strftime("%H:%M:%S", time.gmtime(call.t_send)) + f".{int(call.t_send % 1 * 1000):03d}Z"
            call.detail = f"sent {at}, {call.t_end - call.t_send:.3f} s: engine was {shown}"
            known = ""
            if (call.noop or call.deferred) and died_within(timeline, call.t_send - STALE_S, call.t_end):
                known = "stale_noop"
            bad.append((call, known))
    return checked, bad


# The simulator's violation for a generation on weights a lie-weights fault altered (lifeguard_sim/generation.py):
# judged at every token of every request, it is its own invariant, "no 200 from weights that fail their checksums".
ALTERED_WEIGHTS = "generate_with_altered_weights"


def on_failing_checksums(violations: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The generations that ran on weights failing their checksums, and every other violation."""
    altered = [v for v in violations if v["kind"] == ALTERED_WEIGHTS]
    return altered, [v for v in violations if v["kind"] != ALTERED_WEIGHTS]


# Core bugs the chaos run finds, each pinned by a strict xfail test; reported, not counted, unless --strict.
# A no-op is answered from the proxy's belief without asking vLLM; for one reconcile round after the engine
# dies (and is restarted, maybe), that belief is stale (finding in docs/reliability.md). Longer than this is
# a broken invariant.
STALE_S = 1.0

KNOWN_BUGS = {
    "stale_noop": "a no-op answered within one reconcile round of an engine death (docs/reliability.md; pinned by "
    "test_core_bugs.py::test_a_repeated_sleep_after_the_engine_restarted_awake_is_not_answered_from_a_stale_belief)",
    "in_transit": "not a bug: admitted before the pause began, arrived while vLLM paused; vLLM queues it "
    "(docs/reliability.md); or admitted before the weight change's answer reached the proxy",
}


# A request the gate admitted just before a pause/sleep began may still be on its way to vLLM when vLLM pauses;
# vLLM queues it (it is not run while asleep: that is generate_ran_while_asleep, never excused).
IN_TRANSIT_S = 0.5


def known_violation(violation: dict[str, Any], pausing: list[tuple[int, str, float, float]]) -> str:
    # A generation on invalid weights is never excused, also not for a request that arrived in transit
    # (`in_transit_ran_stale`, issue 20): the proxy ends those before the wake.
    kind = violation["kind"]
    if kind == "generate_while_asleep_or_paused":
        at, pid = float(violation["at"]), violation.get("pid")
        set_out = float(violation.get("set_out", at))  # reached vLLM's HTTP layer, before any slow fault
        if any(p == pid and began <= at and set_out <= ended + IN_TRANSIT_S for p, _, began, ended in pausing):
            return "in_transit"
    # Admitted before the proxy read the weight change's answer: the partition (docs/verification.md, class 21)
    # covers requests admitted after it.
    if (
        kind == "prefix_cache_stale_hit"
        and float(violation["set_out"]) <= float(violation["committed_at"]) + IN_TRANSIT_S
    ):
        return "in_transit"
    return ""


def engine_matches(proxy: dict[str, Any], sim: dict[str, Any], *, session_unknowable: bool = False) -> str | None:
    """Why the proxy's settled state disagrees with the simulator's true state, or None. `session_unknowable`:
    a proxy restart cut a weight-update session, and vLLM has no flag that shows one (docs/behaviour.md)."""
    state = proxy["state"]
    tags = set(sim["asleep_tags"])
    if sim.get("dead"):
        # STARTING: a proxy (re)started while its engine was down has never reached it, and says so. A session the
        # proxy remembers is not compared: the dead process took its own with it, and a /health blip looks the
        # same as a death until vLLM answers again (the proxy forgets it on the restart it sees: seed 7242).
        return None if state in ("FAILED", "STARTING") else f"engine is dead but the proxy says {state}"
    if not session_unknowable and bool(proxy["weight_update_active"]) != bool(sim["weight_update_active"]):
        return f"weight_update_active: proxy {proxy['weight_update_active']}, engine {sim['weight_update_active']}"
    if state == "FAILED":
        # Healthy but broken: it answers garbage, or a tag it calls awake has no memory behind it. Only a
        # restart (the healer's, or the recovery's) mends these in the simulator; the proxy must not
        # call such an engine good. FAILED on an engine that is neither is a proxy stuck in FAILED.
        awake_without_memory = (MEMORY_TAGS - tags) - set(sim["memory"]["resident"])
        if sim["garbage"] or awake_without_memory:
            return None
        return f"proxy FAILED ({proxy.get('last_error')}), engine healthy: tags={sorted(tags)} paused={sim['paused']}"
    if state == "RUNNING":
        ok = not tags and not sim["paused"]
        return None if ok else f"proxy RUNNING, engine tags={sorted(tags)} paused={sim['paused']}"
    if state == "PAUSED":
        ok = not tags and sim["paused"]
        return None if ok else f"proxy PAUSED, engine tags={sorted(tags)} paused={sim['paused']}"
    if state in ("SLEEPING", "UPDATING_WEIGHTS"):
        if set(proxy["asleep_tags"]) == {"scheduling"} and not tags and sim["paused"]:
            return None  # level 0 and a pause look the same from outside; a lie-asleep there cannot be seen
        resident = set(sim["memory"]["resident"])
        if proxy.get("sleep_unconfirmed") and not tags and sim["paused"] and MEMORY_TAGS <= resident:
            return None  # a /sleep from PAUSED that did nothing: the proxy holds it as asleep, unconfirmed
        # A tag woken without its memory (lie-memory on a partial wake) is, to the GPUs, still asleep.
        unmapped = (MEMORY_TAGS - tags) - resident
        believed = set(proxy["asleep_tags"])
        # After a sleep that freed nothing (an asleep tag kept its memory), a partial wake cannot be seen:
        # the proxy keeps the tags it sent asleep, and holds, rather than believe a 200 it cannot check.
        blind = bool(tags & resident) and tags <= believed and believed - tags <= resident
        if believed not in (tags, tags | unmapped) and not blind:
            return f"proxy {state} with tags {proxy['asleep_tags']}, engine tags {sorted(tags)}"
        return None
    return f"proxy not settled: {state}"


# ----- proxy restarts (kill -9 of the proxy, a new one on the same port)
# What the client of an exchange the restart cut sees: a connection error, never an answer.
CUT_OUTCOMES = frozenset({"no_answer", "dropped_mid_response"})


def cut_by_restart(call: Call, downtimes: list[tuple[float, float]]) -> bool:
    """Whether `call` ended in a connection error while a proxy restart cut or refused it."""
    if call.outcome not in CUT_OUTCOMES:
        return False
    return any(call.t_send <= up and killed <= call.t_end + 0.05 for killed, up in downtimes)


def session_cut(calls: list[Call], downtimes: list[tuple[float, float]]) -> bool:
    """Whether a proxy restart came after a weight-update session may have opened and before one closed."""
    opened = [c.t_send for c in calls if c.kind in ("start_weight_update", "update_weights")]
    closed = [c.t_end for c in calls if c.kind == "finish_weight_update" and c.status == 200]
    for kill, _ in downtimes:
        if any(t <= kill for t in opened) and not any(t >= kill for t in closed):
            return True
    return False


def only_kept_requests(pending: Counter[str], states: Mapping[str, dict[str, Any] | None]) -> bool:
    """Whether the clients' requests still open (`pending`: engine -> how many) are all ones a vLLM keeps until a
    resume or a wake: a trainer's pause or keep-mode sleep that the end of the chaos phase left in place. Then
    only the recovery ends them, and waiting for them first ran them past their deadline (make chaos-engines,
    seed 2402: engine a paused 3 s before the phase ended, two requests it had admitted just before, 45 s).
    None may be held by a proxy (a held request still wakes or swaps engines), none on a RUNNING engine (it ends
    by itself), and each engine must count in flight at least the requests open for it."""
    if any(state is None or state["held_requests"] for state in states.values()):
        return False
    for name, count in pending.items():
        state = states.get(name)
        if state is None or state["state"] == "RUNNING" or state["inflight_requests"] < count:
            return False
    return True


# ----- several engines on one GPU (--engines N)
def more_awake_than_fits(moves: list[MemoryMove]) -> tuple[int, int, list[MemoryMove]]:
    """Never more awake than fits: (the device's peak use, its total, the moves that took the device past its
    total), over every memory move of every engine on the device. No move at all is a broken journal, not a
    pass: the peak is then -1."""
    if not moves:
        return -1, 0, []
    total = min(move.total for move in moves)
    over = [move for move in moves if move.device > move.total]
    return max(move.device for move in moves), total, over


# ----- several pods on one GPU (--pods N)
def wake_intervals(journal: Journal) -> list[WakeSpan]:
    return list(journal.wakes)


def overlapping_wakes(
    wakes: dict[str, list[WakeSpan]], downtimes_of: dict[str, list[tuple[float, float]]]
) -> list[str]:
    """Never two wakes overlapping on one GPU (every engine of the run is on GPU 0): each pair of wakes of two
    engines that ran at the same time, as text. Two are excused, each a limit of a lock held by the proxy's
    process rather than by vLLM's (docs/gpu-sharing-across-pods.md): a wake held by a hang fault before it
    mapped anything, and a wake whose proxy was killed -9 while it ran (the kernel released that proxy's lock;
    vLLM's wake went on)."""
    found = []
    spans = sorted((span for engine_spans in wakes.values() for span in engine_spans), key=lambda w: w.began)
    for i, first in enumerate(spans):
        for second in spans[i + 1 :]:
            if second.began >= first.ended:
                break
            if second.engine == first.engine or first.hung or second.hung:
                continue
            if any(first.began <= killed <= first.ended for killed, _ in downtimes_of.get(first.engine, [])):
                continue
            found.append(
                f"{first.engine} woke {first.began:.3f}-{first.ended:.3f}, {second.engine} "
                f"{second.began:.3f}-{second.ended:.3f}"
            )
    return found
