"""Issue 39's targets, one line each under the table `make bench` prints: MET or MISSED with the figure that
decided it, or "not run" where the load (or the case: 64 connections, 512 and 2,048 streams, 10,000 held, a
real vLLM at 1, 16 and 64 connections) was not part of this run. Each figure is the one the table judges
(report.py), against the same TARGETS (targets.py)."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from benchmarks.targets import TARGETS, measured

NOT_RUN = "not run"


def _ratio(runs: dict[str, Any], path: str, of: str, key: str) -> float:
    a, b = (runs.get(path) or {}).get(key, math.nan), (runs.get(of) or {}).get(key, math.nan)
    return a / b if measured(a) and measured(b) and b else math.nan


def _median(values: list[float] | None) -> float:
    return statistics.median(values) if values else math.nan


def _line(what: str, key: str, value: float, shown: str, *, also: bool = True) -> str:
    """`also`: a second condition of the target (nothing lost, no 5xx), False when it failed."""
    target = TARGETS[key]
    if not measured(value):
        return f"- {NOT_RUN} — {what} (target {target.text})"
    verdict = "MET" if target.met(value) and also else "MISSED"
    return f"- {verdict} — {what}: {shown} (target {target.text})"


def issue39_lines(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    fixed, outside = res.get("fixed") or {}, res.get("outside") or {}
    at64 = {path: fixed.get(f"{path}@64") for path in ("nginx", "lifeguard", "lifeguard-2e")}
    lines = ["issue 39's targets (load average with the table above):"]
    cpu = _ratio(at64, "lifeguard", "nginx", "cpu_us_per_req")
    lines.append(_line("rig's fixed row, CPU per request, 64 conn, lifeguard ÷ nginx", "cpu_vs_nginx@64", cpu,
                       f"{cpu:.2f}×"))  # fmt: skip
    rps = _ratio(at64, "lifeguard", "nginx", "rps")
    lines.append(_line("rig's fixed row, req/s, 64 conn, lifeguard ÷ nginx", "rps_vs_nginx@64", rps, f"{rps:.2f}×"))
    for key, figure in (("cpu_vs_nginx", "CPU per request"), ("rps_vs_nginx", "req/s")):
        ratios = outside.get(key) or []
        median = _median(ratios)
        runs = " / ".join(f"{r:.2f}×" for r in ratios)
        lines.append(_line(f"outside row, {figure}, lifeguard ÷ nginx, median (runs)", f"outside_{key}", median,
                           f"{median:.2f}× ({runs})"))  # fmt: skip
    two = _ratio(at64, "lifeguard-2e", "lifeguard", "cpu_us_per_req")
    lines.append(_line("two engines ÷ one engine, CPU per request, 64 conn", "cpu_2e_vs_1e@64", two, f"{two:.2f}×"))
    release = res.get("release") or {}
    ratios = release.get("ratios") or []
    worst = ratios[-1] if ratios and release.get("count") == 2048 else math.nan
    intact = release.get("answered_share", 0) >= 1 and not release.get("server_errors")
    shown = f"worst {worst:.2f}× of {len(ratios)} runs; " if ratios else ""
    shown += f"{release.get('answered_share', 0):.0%} answered to [DONE], {release.get('server_errors', 0):.0f} 5xx"
    lines.append(_line("release burst of 2,048 held streams, last first byte, lifeguard ÷ nginx",
                       "release_burst_vs_nginx", worst, shown, also=intact))  # fmt: skip
    sse = res.get("sse") or {}
    for streams in (512, 2048):
        per_run = sse.get(f"cpu@{streams}") or {}
        worst = per_run.get("worst", math.nan)
        shown = f"worst {worst:.2f}× / best {per_run.get('best', math.nan):.2f}× of {per_run.get('runs', 0):g}"
        lines.append(_line(f"SSE CPU per event, {streams:,} streams, lifeguard ÷ nginx", "sse_cpu_vs_nginx", worst,
                           shown))  # fmt: skip
    hold = res.get("hold") or {}
    size = hold.get("bytes_per_held_client", math.nan) if args.held >= 10_000 else math.nan
    lines.append(_line("memory per held client, 10,000 held", "hold_bytes_per_request", size, f"{size:,.0f} B"))
    vllm = res.get("vllm") or {}
    for conns in (1, 16, 64):
        spread = vllm.get(f"spread@{conns}") or {}
        median = spread.get("median", math.nan)
        shown = f"{median:.2f}× ({spread.get('min', math.nan):.2f}–{spread.get('max', math.nan):.2f}×)"
        lines.append(_line(f"real vLLM, {conns} conn, through ÷ direct, median (min–max)", "vllm_rps_vs_direct",
                           median, shown))  # fmt: skip
    return lines
