"""The check as a whole: what is at the URLs, the read-only findings, and (with ``lifecycle``) every row in each
column, through the lifeguard first, then vLLM itself, the engine restored between rows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..gpu.readers import GpuMemoryReader, make_reader
from .client import CALL_TIMEOUT_S, Http
from .column import PENDING_WINDOW_S, STREAM_TOKENS, Column
from .matrix import Row, select
from .scenarios import GREEN, RED, SKIP, Finding
from .target import CheckError, Target, inspect
from .target import adapters as listed_adapters

#: A row that has not finished by then is a hang: every wait inside it has a shorter deadline.
ROW_DEADLINE_S = 150.0
INFO = "info"


@dataclass
class Options:
    url: str | None = None
    direct: str | None = None
    through: str | None = None
    lifecycle: bool = False
    force: bool = False
    rows: list[str] | None = None
    token: str | None = None
    gpu_probe: str = "nvml"
    lora: list[tuple[str, str]] = field(default_factory=list)  # (name, path) to load before the rows
    direct_column: bool = True  # False: through the lifeguard only, even when its upstream is reachable
    pending_window_s: float = PENDING_WINDOW_S
    stream_tokens: int = STREAM_TOKENS  # a stream a row pauses mid-way
    call_timeout_s: float = CALL_TIMEOUT_S  # the deadline of one lifecycle call


@dataclass
class Cell:
    verdict: str
    why: str
    seconds: float
    steps: list[dict[str, Any]]
    state_after: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "why": self.why,
            "seconds": round(self.seconds, 3),
            "steps": self.steps,
            "state_after": self.state_after,
        }


@dataclass
class Result:
    row: Row
    cells: dict[str, Cell]


@dataclass
class Report:
    mode: str
    targets: dict[str, Target]
    deployment: list[dict[str, str]]
    results: list[Result]
    started_at: float
    seconds: float = 0.0

    @property
    def columns(self) -> list[str]:
        return [name for name in ("direct", "through") if name in self.targets]

    @property
    def judged_column(self) -> str:
        """The column a client uses: through the lifeguard when there is one, else vLLM itself."""
        return "through" if "through" in self.targets else "direct"

    @property
    def exit_code(self) -> int:
        judged = self.judged_column
        if any(finding["verdict"] == RED for finding in self.deployment if finding["column"] == judged):
            return 1
        return 1 if any(result.cells[judged].verdict == RED for result in self.results) else 0

    def counts(self, column: str) -> dict[str, int]:
        verdicts = [result.cells[column].verdict for result in self.results if column in result.cells]
        return {verdict: verdicts.count(verdict) for verdict in (GREEN, RED, SKIP)}


async def check(options: Options) -> Report:
    """Run the check; `CheckError` (exit 2) when a target cannot be checked."""
    rows = select(options.rows) if options.lifecycle else ()
    started = time.time()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        targets = await _targets(session, options)
        gpu = make_reader(options.gpu_probe)
        deployment = [finding for name, target in targets.items() for finding in findings(name, target)]
        report = Report("lifecycle" if options.lifecycle else "read-only", targets, deployment, [], started)
        if options.lifecycle:
            _refuse_unfit(targets, options.force)
            # Through the lifeguard first, while its view of the engine is its own; vLLM's own column then goes
            # behind its back (it adopts what it sees as drift), and the lifeguard is settled again at the end.
            columns = {name: await _column(session, name, target, options, gpu) for name, target in targets.items()}
            report.results = [Result(row, {}) for row in rows]
            for name in sorted(columns, reverse=True):
                await _run_column(columns[name], report.results, options.lora)
            if "through" in columns and "direct" in columns:
                report.deployment.append(await _settled(columns["through"]))
    report.seconds = time.time() - started
    return report


async def _targets(session: aiohttp.ClientSession, options: Options) -> dict[str, Target]:
    targets: dict[str, Target] = {}
    if options.direct:
        targets["direct"] = await inspect(Http(session, options.direct), gpu_probe=options.gpu_probe)
    given = options.through or options.url
    if given:
        target = await inspect(Http(session, given, options.token), gpu_probe=options.gpu_probe)
        if target.kind == "vllm":
            if options.through:
                raise CheckError(f"--through {given} is a vLLM, not a lifeguard: give it as --direct or alone.")
            targets.setdefault("direct", target)
        else:
            targets["through"] = target
            if options.direct_column and "direct" not in targets and target.upstream and target.upstream_reachable:
                targets["direct"] = await inspect(Http(session, target.upstream), gpu_probe="none")
    if not targets:
        raise CheckError("no URL to check: give one (vLLM or a lifeguard), or --direct URL and --through URL.")
    return dict(sorted(targets.items()))  # direct before through


def findings(column: str, target: Target) -> list[dict[str, str]]:
    """What the read-only pass found about one target: info, or green and red where a guarantee holds or not."""
    out: list[dict[str, str]] = []

    def add(id: str, verdict: str, why: str) -> None:
        out.append({"column": column, "id": id, "verdict": verdict, "why": why})

    profile = f"the lifeguard's {target.profile} profile" if target.profile else "no profile the lifeguard models"
    add(
        "version",
        INFO,
        f"{target.kind} at {target.url}: vLLM {target.vllm_version} ({profile}), model {target.model!r}",
    )
    add(
        "dev-mode",
        GREEN if target.dev_mode else RED,
        "VLLM_SERVER_DEV_MODE=1: the lifecycle routes are served"
        if target.dev_mode
        else "/is_sleeping is not served: vLLM was started without VLLM_SERVER_DEV_MODE=1",
    )
    sleep_mode = {
        True: (GREEN, "--enable-sleep-mode is on"),
        # Not red here: what it costs (a /sleep that frees nothing, class 1) is the physical row's to show.
        False: (INFO, "--enable-sleep-mode is off: a /sleep answers 200 and frees nothing (class 1)"),
        None: (INFO, "/server_info does not say whether sleep mode is on"),
    }[target.sleep_mode]
    add("sleep-mode", *sleep_mode)
    unclassified = target.routes.get("unclassified", [])
    if target.routes:
        served = sum(len(paths) for paths in target.routes.values())
        add(
            "routes",
            RED if unclassified else GREEN,
            f"{len(unclassified)} of {served} routes the lifeguard's table does not classify: {', '.join(unclassified)}"
            if unclassified
            else f"all {served} routes in /openapi.json are classified by the lifeguard's route table",
        )
    else:
        add("routes", INFO, "/openapi.json is not served: the routes could not be listed")
    if target.kind == "lifeguard":
        add(
            "admin-token",
            GREEN if target.token_enforced else INFO,
            "the admin token is enforced (401 without it)"
            if target.token_enforced
            else "no admin token is configured: anyone who reaches the port can drive the lifecycle",
        )
        serving = target.serving or {}
        add(
            "serving",
            GREEN if serving.get("agrees") else RED,
            f"/lifeguard/serving answered {serving.get('status')}"
            f" in {serving.get('state')}"
            + (f" ({serving.get('cause')})" if serving.get("cause") else "")
            + ("" if serving.get("agrees") else ": it disagrees with the state"),
        )
        add(
            "upstream",
            INFO,
            f"guards {target.upstream}, "
            + (
                "reachable from here: both columns run"
                if target.upstream_reachable
                else "not reachable from here: the direct column needs --direct URL"
            ),
        )
    if target.gpu.get("available"):
        add("gpu", INFO, "the GPU memory is readable on this machine: the physical rows can run")
    elif target.gpu.get("reason") is not None:
        add("gpu", INFO, f"no GPU memory readable on this machine ({target.gpu['reason']})")
    return out


def _refuse_unfit(targets: dict[str, Target], force: bool) -> None:
    for target in targets.values():
        if not target.dev_mode:
            raise CheckError(
                f"{target.url} does not serve the lifecycle routes (start vLLM with "
                "VLLM_SERVER_DEV_MODE=1): --lifecycle has nothing to run."
            )
        if target.busy and not force:
            raise CheckError(
                f"--lifecycle would disrupt {target.url}, which is busy ({target.busy}): run it when "
                "the engine is idle, or pass --force."
            )


async def _column(
    session: aiohttp.ClientSession, name: str, target: Target, options: Options, gpu: GpuMemoryReader
) -> Column:
    http = Http(session, target.url, options.token if target.kind == "lifeguard" else None, options.call_timeout_s)
    column = Column(name, http, target.kind == "lifeguard", target.model, gpu, list(target.lora_adapters))
    column.pending_window_s, column.stream_tokens = options.pending_window_s, options.stream_tokens
    return column


async def load_adapters(column: Column, adapters: list[tuple[str, str]]) -> str | None:
    """Load the adapters ``--lora`` names that the engine does not list yet; why not, when one fails."""
    column.lora_adapters = await listed_adapters(column.http)  # the other column may have loaded them
    for name, path in adapters:
        if name in column.lora_adapters:
            continue
        body = {"lora_name": name, "lora_path": path}
        reply = await column.http.call("POST", "/v1/load_lora_adapter", json_body=body)
        if reply.status != 200:
            return f"the LoRA adapter {name} could not be loaded: {reply.summary()[:120]}"
        column.lora_adapters.append(name)
    return None


async def _run_column(column: Column, results: list[Result], adapters: list[tuple[str, str]]) -> None:
    lost = await column.restore()  # after the other column's rows, the engine as a client finds it
    if lost is None:
        lost = await load_adapters(column, adapters)
    if lost is None:
        column.golden = await column.answer_text()
        lost = None if column.golden else "the engine answers no completion before the first row"
    for result in results:
        row = result.row
        if lost is not None:
            result.cells[column.name] = Cell(SKIP, f"not run: {lost}", 0.0, [], {})
            continue
        column.steps = []
        started = time.monotonic()
        finding = await run_row(row, column)
        steps = [reply.evidence() for reply in column.steps]
        state_after = await column.flags()
        result.cells[column.name] = Cell(finding.verdict, finding.why, time.monotonic() - started, steps, state_after)
        column.steps = []
        problem = await column.restore()
        if problem is not None:
            lost = f"after {row.id}, {problem}"


def _no_answer_is_red(finding: Finding, column: Column) -> Finding:
    """A call that got no answer, or lost its connection, misled its client whatever the row concluded: it would
    hang, or see a crash."""
    unanswered = [reply for reply in column.steps if reply.status is None]
    if not unanswered or finding.verdict == RED:
        return finding
    first = unanswered[0]
    return Finding(RED, f"{first.method} {first.path}: {first.failure}")


async def _settled(column: Column) -> dict[str, str]:
    """The lifeguard after vLLM's own column went behind its back: back to RUNNING, or why not."""
    problem = await column.restore()
    if problem is None:
        return {
            "column": "through",
            "id": "left-as-found",
            "verdict": GREEN,
            "why": "after both columns the lifeguard is RUNNING and the engine answers as before",
        }
    return {
        "column": "through",
        "id": "left-as-found",
        "verdict": RED,
        "why": f"after vLLM's own column, made behind the lifeguard's back, {problem}",
    }


async def run_row(row: Row, column: Column) -> Finding:
    """One row against one column, as the command runs it (tests/conformance runs the rows through this too)."""
    return _no_answer_is_red(await _run_row(row, column), column)


async def _run_row(row: Row, column: Column) -> Finding:
    try:
        async with asyncio.timeout(ROW_DEADLINE_S):
            return await row.run(column)
    except TimeoutError:
        return Finding(RED, f"the row did not finish within {ROW_DEADLINE_S:g} s: a call hung")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # an answer of a shape the row did not expect
        return Finding(RED, f"the row could not read an answer: {type(exc).__name__}: {exc}")
