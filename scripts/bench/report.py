"""The table `make bench` prints: one row per figure, direct / nginx proxy / vllm-lifeguard, judged by TARGETS."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Sequence
from typing import Any

from targets import judge, measured

HEAD = ["figure", "direct", "nginx proxy", "vllm-lifeguard", "lifeguard vs direct", "lifeguard vs nginx", "target", ""]
NO_TARGET = ["", ""]


def fmt(value: float | None, unit: str = "") -> str:
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
    if not measured(value):
        return "-"
    return ("+" if value >= 0 else "−") + fmt(abs(value), "ms")


def ratio(a: float, b: float) -> float:
    return a / b if measured(a) and measured(b) and b else math.nan


def per_event(us: float) -> str:
    """CPU µs per SSE event, and the events/s one core would relay at that cost."""
    if not measured(us) or us <= 0:
        return "-"
    return f"{us:.1f} µs (→ {1e6 / us:,.0f})"


def lifeguard_only(figure: str, value: str, judged: list[str] = NO_TARGET) -> list[str]:
    return [figure, "", "", value, "", "", *judged]


def three_ways(figure: str, values: Sequence[float], unit: str, judged: list[str] = NO_TARGET) -> list[str]:
    """A figure on all three paths (direct, nginx, lifeguard) with lifeguard's ratio to (unit "x") or
    difference from (unit "ms") the other two."""
    d, n, lg = values
    if unit == "ms":
        return [figure, fmt(d, "ms"), fmt(n, "ms"), fmt(lg, "ms"), delta(lg - d), delta(lg - n), *judged]
    return [figure, fmt(d), fmt(n), fmt(lg), fmt(ratio(lg, d), "x"), fmt(ratio(lg, n), "x"), *judged]


def fixed_rows(fixed: dict[str, Any], conns: list[int]) -> list[list[str]]:
    rows = []
    for c in conns:
        d, n, lg = fixed.get(f"direct@{c}"), fixed.get(f"nginx@{c}"), fixed.get(f"lifeguard@{c}")
        if not (d and n and lg):
            continue
        judged = judge("rps_vs_nginx@64", ratio(lg["rps"], n["rps"])) if c == 64 else NO_TARGET
        rows.append(three_ways(f"req/s, {c} conn", [d["rps"], n["rps"], lg["rps"]], "x", judged))
        for q in ("p50", "p99"):
            key = {("p50", 1): "p50_over_nginx_ms@1", ("p99", 256): "p99_over_nginx_ms@256"}.get((q, c))
            over_nginx = (lg[f"{q}_us"] - n[f"{q}_us"]) / 1000
            judged = judge(key, over_nginx) if key else NO_TARGET
            ms = [fixed_run[f"{q}_us"] / 1000 for fixed_run in (d, n, lg)]
            rows.append(three_ways(f"{q} latency, {c} conn", ms, "ms", judged))
    mid = 64 if 64 in conns else conns[-1]
    if fixed.get(f"lifeguard@{mid}"):
        n, lg = fixed[f"nginx@{mid}"], fixed[f"lifeguard@{mid}"]
        cpu = ratio(lg["cpu_us_per_req"], n["cpu_us_per_req"])
        us = [fmt(n["cpu_us_per_req"], "us"), fmt(lg["cpu_us_per_req"], "us")]
        rows.append([f"proxy CPU per request, {mid} conn", "", *us, "", fmt(cpu, "x"), "", ""])
    top = conns[-1]
    if fixed.get(f"lifeguard@{top}"):
        n, lg = fixed[f"nginx@{top}"], fixed[f"lifeguard@{top}"]
        rss = [fmt(n["rss"], "MiB"), fmt(lg["rss"], "MiB")]
        rows.append([f"proxy RSS under load, {top} conn", "", *rss, "", "", "", ""])
    return rows


def sse_rows(sse: dict[str, Any], streams_list: list[int], rate: float) -> list[list[str]]:
    rows = []
    for s in streams_list:
        d, n, lg = sse.get(f"direct@{s}max"), sse.get(f"nginx@{s}max"), sse.get(f"lifeguard@{s}max")
        if d and n and lg:
            eps = [run["events_per_s"] for run in (d, n, lg)]
            judged = judge("sse_events_per_s", lg["events_per_s"])
            rows.append(three_ways(f"SSE events/s relayed, {s} streams, source unpaced", eps, "x", judged))
            cpu = ratio(lg["cpu_us_per_event"], n["cpu_us_per_event"])
            rows.append(
                [
                    f"proxy CPU per SSE event (→ events/s per core), {s} streams",
                    "",
                    per_event(n["cpu_us_per_event"]),
                    per_event(lg["cpu_us_per_event"]),
                    "",
                    fmt(cpu, "x"),
                    *judge("sse_cpu_us_per_event", lg["cpu_us_per_event"]),
                ]
            )
        d, n, lg = sse.get(f"direct@{s}"), sse.get(f"nginx@{s}"), sse.get(f"lifeguard@{s}")
        if not (d and n and lg):
            continue
        eps = [run["events_per_s"] for run in (d, n, lg)]
        rows.append(three_ways(f"SSE events/s, {s} streams, source paced at {rate:,.0f}/s", eps, "x"))
        for q in ("p50", "p99"):
            ms = [run[f"{q}_us"] / 1000 for run in (d, n, lg)]
            rows.append(three_ways(f"SSE per-event {q} latency, {s} streams, paced", ms, "ms"))
        if "ready_ms" in lg:
            ready = [run["ready_ms"] for run in (d, n, lg)]
            rows.append(three_ways(f"SSE: {s} streams opened at once → every one delivering, paced", ready, "ms"))
    return rows


def hold_rows(hold: dict[str, Any], held: int) -> list[list[str]]:
    all_answered = hold["ok"] == held
    drain = ratio(hold["drain_rps"], hold["steady_rps"]) if all_answered else 0.0
    return [
        lifeguard_only(
            f"hold: wake end → first of {held:,} forwarded",
            fmt(hold["first_ms"], "ms"),
            judge("hold_first_ms", hold["first_ms"]),
        ),
        lifeguard_only("… of which verification (wake end → flags read)", fmt(hold["verified_ms"], "ms")),
        lifeguard_only("… of which the release (flags read → first forwarded)", fmt(hold["release_ms"], "ms")),
        lifeguard_only(f"hold: wake end → last of {held:,} forwarded", fmt(hold["last_ms"], "ms")),
        lifeguard_only(
            "hold: drain rate vs steady state (256 conn)",
            f"{fmt(hold['drain_rps'])} vs {fmt(hold['steady_rps'])}/s",
            judge("hold_drain_vs_steady", drain),
        ),
        lifeguard_only(
            "hold: held requests answered 200",
            f"{hold['ok']:,.0f} of {held:,}",
            judge("hold_answered_share", hold["ok"] / held),
        ),
        lifeguard_only(
            "hold: memory per held request (RSS Δ / count)",
            fmt(hold["bytes_per_held_client"], "B"),
            judge("hold_bytes_per_request", hold["bytes_per_held_client"]),
        ),
        lifeguard_only("… of which the open client connection", fmt(hold["bytes_per_conn"], "B")),
        lifeguard_only("… of which the held request itself", fmt(hold["bytes_per_held"], "B")),
    ]


def lifecycle_rows(lc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for op in ("sleep", "wake"):
        direct, lifeguard = lc[f"direct_{op}_ms"], lc[f"lifeguard_{op}_ms"]
        figure = f"lifecycle: {op} (engine op {lc['op_ms']:g} ms)"
        judged = judge("lifecycle_added_ms", lifeguard - direct)
        rows.append([figure, fmt(direct, "ms"), "", fmt(lifeguard, "ms"), delta(lifeguard - direct), "", *judged])
    return rows


def swap_rows(sw: dict[str, Any]) -> list[list[str]]:
    engine = 2 * sw["op_ms"]
    figure = f"model swap: request for a sleeping model → first byte (engine sleep + wake {engine:g} ms)"
    judged = judge("swap_added_ms", sw["swap_added_ms"])
    return [[figure, fmt(engine, "ms"), "", fmt(sw["swap_ms"], "ms"), delta(sw["swap_added_ms"]), "", *judged]]


def build_table(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = fixed_rows(res.get("fixed", {}), args.conns) + sse_rows(res.get("sse", {}), args.streams, args.sse_rate)
    if res.get("hold"):
        rows += hold_rows(res["hold"], args.held)
    if res.get("lifecycle"):
        rows += lifecycle_rows(res["lifecycle"])
    if res.get("swap"):
        rows += swap_rows(res["swap"])
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def machine() -> str:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return f"{os.cpu_count()} CPUs ({model}), load average {' '.join(load)}"
