"""The table `make bench` prints: one row per figure on every path (direct, the peers nginx / Envoy /
vllm-router, lifeguard, lifeguard of two engines, the baseline checkout's lifeguard), lifeguard's ratio to
nginx and to the best peer, judged by TARGETS; the two-engine and before/after ratios; and the real-vLLM
table when that load ran."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
from typing import Any

from benchmarks.rig import PEERS
from benchmarks.targets import judge, measured

# The columns of the main table, in order: the load's paths (rig.PATHS), then lifeguard's ratios.
COLUMNS = ("direct", "nginx", "envoy", "vllm-router", "lifeguard", "lifeguard-2e", "lifeguard-base")
TITLES = {
    "direct": "direct",
    "nginx": "nginx",
    "envoy": "Envoy",
    "vllm-router": "vllm-router",
    "lifeguard": "lifeguard",
    "lifeguard-2e": "lifeguard, 2 engines",
    "lifeguard-base": "lifeguard before (--baseline-src)",
}
NO_TARGET = ["", ""]


def head(args: argparse.Namespace) -> list[str]:
    return [
        "figure",
        *(TITLES[c] for c in COLUMNS),
        "lifeguard vs nginx",
        "lifeguard vs best of Envoy, vllm-router",
        "target",
        "",
    ]


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
    return [figure, "", "", "", "", value, "", "", "", "", *judged]


def cell(value: float | None, unit: str) -> str:
    if value is None or not measured(value):
        return "-"
    if unit == "ev":
        return per_event(value)
    return fmt(value, unit)


def best_peer(values: dict[str, float], lower_is_better: bool) -> float:
    """The better of Envoy and vllm-router on this figure: the peers the issue puts lifeguard ahead of
    (nginx, the other peer, is the reference and has its own column)."""
    peers = [values[p] for p in PEERS if p != "nginx" and measured(values.get(p))]
    if not peers:
        return math.nan
    return min(peers) if lower_is_better else max(peers)


def compare(
    figure: str, values: dict[str, float], unit: str, lower_is_better: bool, judged: list[str] = NO_TARGET
) -> list[str]:
    """A figure on every path, with lifeguard's difference from (unit "ms") or ratio to (any other unit)
    nginx and the better of Envoy and vllm-router on this figure (the faster, the cheaper)."""
    cells = [cell(values.get(c), unit) for c in COLUMNS]
    lg, nginx, best = (
        values.get("lifeguard", math.nan),
        values.get("nginx", math.nan),
        best_peer(values, lower_is_better),
    )
    if unit == "ms":
        vs = [delta(lg - nginx), delta(lg - best)]
    else:
        vs = [fmt(ratio(lg, nginx), "x"), fmt(ratio(lg, best), "x")]
    return [figure, *cells, *vs, *judged]


def fixed_rows(fixed: dict[str, Any], conns: list[int]) -> list[list[str]]:
    rows = []
    for c in conns:
        runs = {path: fixed[f"{path}@{c}"] for path in COLUMNS if fixed.get(f"{path}@{c}")}
        if "lifeguard" not in runs:
            continue
        rps = {path: r["rps"] for path, r in runs.items()}
        judged = judge("rps_vs_nginx@64", ratio(rps["lifeguard"], rps.get("nginx", math.nan))) if c == 64 else NO_TARGET
        rows.append(compare(f"req/s, {c} conn", rps, "", False, judged))
        for q in ("p50", "p99"):
            key = {("p50", 1): "p50_over_nginx_ms@1", ("p99", 256): "p99_over_nginx_ms@256"}.get((q, c))
            ms = {path: r[f"{q}_us"] / 1000 for path, r in runs.items()}
            judged = judge(key, ms["lifeguard"] - ms.get("nginx", math.nan)) if key else NO_TARGET
            rows.append(compare(f"{q} latency, {c} conn", ms, "ms", True, judged))
        cpu = {path: r["cpu_us_per_req"] for path, r in runs.items() if path != "direct"}
        judged = judge("cpu_vs_envoy@64", ratio(cpu["lifeguard"], cpu.get("envoy", math.nan))) if c == 64 else NO_TARGET
        rows.append(compare(f"proxy CPU per request, {c} conn", cpu, "us", True, judged))
        nginx_cpu = cpu.get("nginx", math.nan)
        if c == 64:
            one_cpu = ratio(cpu["lifeguard"], nginx_cpu)
            rows.append(lifeguard_only("… lifeguard ÷ nginx, CPU per request, 64 conn", fmt(one_cpu, "x"),
                                       judge("cpu_vs_nginx@64", one_cpu)))  # fmt: skip
        if c == 64 and "lifeguard-2e" in runs:
            two_rps = ratio(rps["lifeguard-2e"], rps.get("nginx", math.nan))
            two_cpu = ratio(cpu["lifeguard-2e"], nginx_cpu)
            rows.append(lifeguard_only("… two engines ÷ nginx, req/s, 64 conn", fmt(two_rps, "x"),
                                       judge("rps_2e_vs_nginx@64", two_rps)))  # fmt: skip
            rows.append(lifeguard_only("… two engines ÷ nginx, CPU per request, 64 conn", fmt(two_cpu, "x"),
                                       judge("cpu_2e_vs_nginx@64", two_cpu)))  # fmt: skip
        two = ratio(cpu.get("lifeguard-2e", math.nan), cpu["lifeguard"])
        if measured(two):
            judged = judge("cpu_2e_vs_1e@64", two) if c == 64 else NO_TARGET
            rows.append(lifeguard_only(f"… two engines (by model) ÷ one engine, CPU per request, {c} conn",
                                       fmt(two, "x"), judged))  # fmt: skip
        before = ratio(cpu["lifeguard"], cpu.get("lifeguard-base", math.nan))
        if measured(before):
            judged = judge("cpu_vs_baseline@64", before) if c == 64 else NO_TARGET
            rows.append(lifeguard_only(f"… one engine ÷ the baseline checkout, CPU per request, {c} conn",
                                       fmt(before, "x"), judged))  # fmt: skip
    top = conns[-1]
    if fixed.get(f"lifeguard@{top}"):
        rss = {path: fixed[f"{path}@{top}"]["rss"] for path in COLUMNS[1:] if fixed.get(f"{path}@{top}")}
        rows.append(compare(f"proxy RSS under load, {top} conn", rss, "MiB", True))
    return rows


def outside_rows(out: dict[str, Any]) -> list[list[str]]:
    """Issue 39's outside measurement: one fixed body, process-tree CPU, variants alternated (outside.py)."""
    paths = [c for c in COLUMNS if out.get(c)]
    if "lifeguard" not in paths:
        return []
    what = "outside's configuration (wrk -t1 -c64, one body, process trees)"
    cpu = {path: out[path]["cpu_us_per_req"] for path in paths}
    rps = {path: out[path]["rps"] for path in paths}
    rows = [compare(f"{what}: CPU per request", cpu, "us", True), compare(f"{what}: req/s", rps, "", False)]
    for key, figure in (("cpu_vs_nginx", "CPU per request"), ("rps_vs_nginx", "req/s")):
        ratios = out.get(key) or []
        if ratios:
            median = statistics.median(ratios)
            runs = " / ".join(fmt(r, "x") for r in ratios)
            rows.append(lifeguard_only(f"… lifeguard ÷ nginx, {figure}, outside's configuration: median (runs)",
                                       f"{fmt(median, 'x')} ({runs})", judge(f"outside_{key}", median)))  # fmt: skip
    return rows


def release_rows(rel: dict[str, Any]) -> list[list[str]]:
    """The release burst (release.py): held streams released at a verified resume against nginx's fresh streams."""
    if not rel.get("lifeguard") or not rel.get("ratios"):
        return []
    count, ratios = rel["count"], rel["ratios"]
    ms = {path: rel[path]["last_first_ms"] for path in ("nginx", "lifeguard")}
    figure = (f"release burst: {count:,} streams held through a weight sync, resume's 200 → last first byte "
              f"(nginx: {count:,} fresh streams sent at once → last first byte), median")  # fmt: skip
    share = rel["answered_share"] if not rel["server_errors"] else 0.0
    return [
        compare(figure, ms, "ms", True),
        lifeguard_only(f"… lifeguard ÷ nginx, worst / best of {len(ratios)}",
                       f"{fmt(ratios[-1], 'x')} / {fmt(ratios[0], 'x')}", judge("release_burst_vs_nginx", ratios[-1])),
        lifeguard_only("… held streams answered 200 to [DONE], every run (5xx)",
                       f"{rel['answered_share']:.0%} ({rel['server_errors']:.0f})",
                       judge("release_answered_share", share)),
        lifeguard_only("… lifeguard's peak RSS over the run (VmHWM), median / max",
                       f"{fmt(rel['lifeguard']['peak_rss'], 'MiB')} / {fmt(rel['peak_rss_max'], 'MiB')}"),
    ]  # fmt: skip


def sse_rows(sse: dict[str, Any], streams_list: list[int], rate: float) -> list[list[str]]:
    rows = []
    for s in streams_list:
        runs = {path: sse[f"{path}@{s}max"] for path in COLUMNS if sse.get(f"{path}@{s}max")}
        if "lifeguard" in runs:
            eps = {path: r["events_per_s"] for path, r in runs.items()}
            judged = judge("sse_events_per_s", eps["lifeguard"])
            rows.append(compare(f"SSE events/s relayed, {s} streams, source unpaced", eps, "", False, judged))
            cpu = {path: r["cpu_us_per_event"] for path, r in runs.items() if path != "direct"}
            per_run = sse.get(f"cpu@{s}") or {}
            every_run = s >= 512 and per_run  # issue 39: at 512 and 2,048 streams, judged on every run
            median = ratio(cpu["lifeguard"], cpu.get("nginx", math.nan))
            judged = NO_TARGET if every_run else judge("sse_cpu_vs_nginx", median)
            figure = f"proxy CPU per SSE event (→ events/s per core), {s} streams"
            rows.append(compare(figure, cpu, "ev", True, judged))
            if every_run:
                figure = f"… lifeguard ÷ nginx, CPU per SSE event, {s} streams, worst / best of {per_run['runs']:g}"
                cells = f"{fmt(per_run['worst'], 'x')} / {fmt(per_run['best'], 'x')}"
                rows.append(lifeguard_only(figure, cells, judge("sse_cpu_vs_nginx", per_run["worst"])))
        runs = {path: sse[f"{path}@{s}"] for path in COLUMNS if sse.get(f"{path}@{s}")}
        if "lifeguard" not in runs:
            continue
        eps = {path: r["events_per_s"] for path, r in runs.items()}
        rows.append(compare(f"SSE events/s, {s} streams, source paced at {rate:,.0f}/s", eps, "", False))
        for q in ("p50", "p99"):
            ms = {path: r[f"{q}_us"] / 1000 for path, r in runs.items()}
            rows.append(compare(f"SSE per-event {q} latency, {s} streams, paced", ms, "ms", True))
        ready = {path: r["ready_ms"] for path, r in runs.items() if "ready_ms" in r}
        if "lifeguard" in ready:
            rows.append(compare(f"SSE: {s} streams opened at once → every one delivering, paced (median)", ready,
                                "ms", True))  # fmt: skip
        burst = sse.get(f"burst@{s}") or {}
        if burst:
            figure = f"… lifeguard ÷ nginx, {s} streams at once → all delivering, worst / best of {burst['runs']:g}"
            judged = judge("sse_burst_vs_nginx", burst["worst"]) if s >= 512 else NO_TARGET
            rows.append(lifeguard_only(figure, f"{fmt(burst['worst'], 'x')} / {fmt(burst['best'], 'x')}", judged))
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
        figure = f"lifecycle: {op} (engine op {lc['op_ms']:g} ms; last column: lifeguard − direct)"
        judged = judge("lifecycle_added_ms", lifeguard - direct)
        row = [figure, fmt(direct, "ms"), "", "", "", fmt(lifeguard, "ms"), "", "", "", delta(lifeguard - direct)]
        rows.append(row + judged)
    return rows


def swap_rows(sw: dict[str, Any]) -> list[list[str]]:
    engine = 2 * sw["op_ms"]
    figure = f"model swap: request for a sleeping model → first byte (engine sleep + wake {engine:g} ms in 'direct')"
    judged = judge("swap_added_ms", sw["swap_added_ms"])
    row = [figure, fmt(engine, "ms"), "", "", "", fmt(sw["swap_ms"], "ms"), "", "", "", delta(sw["swap_added_ms"])]
    return [row + judged]


def mixed_table(mixed: dict[str, Any]) -> list[str]:
    """Mixed traffic over two models that do not fit together: turns against naive alternation."""
    turns, naive = mixed.get("turns"), mixed.get("alternation")
    if not turns or not naive:
        return []
    cols = ["mixed traffic, two models, one fits", f"turns (swap_quantum_s {turns['quantum_s']:g} s)",
            "naive alternation (swap_quantum_s 0)", "turns vs alternation"]  # fmt: skip
    rows = [
        ("requests answered 200", fmt(turns["ok"]) + f" of {turns['requests']:,.0f}",
         fmt(naive["ok"]) + f" of {naive['requests']:,.0f}", fmt(ratio(turns["ok"], naive["ok"]), "x")),
        ("refused", fmt(turns["refused"]), fmt(naive["refused"]), ""),
        ("swaps", fmt(turns["swaps"]), fmt(naive["swaps"]), ""),
        ("requests per swap", f"{turns['requests_per_swap']:.1f}", f"{naive['requests_per_swap']:.1f}",
         fmt(ratio(turns["requests_per_swap"], naive["requests_per_swap"]), "x")),
        ("swaps per minute", f"{turns['swaps_per_min']:.1f}", f"{naive['swaps_per_min']:.1f}", ""),
        ("request latency p50 (its swap wait included)", f"{turns['p50_s']:.2f} s", f"{naive['p50_s']:.2f} s", ""),
        ("request latency p99", f"{turns['p99_s']:.2f} s", f"{naive['p99_s']:.2f} s", ""),
        ("throughput", f"{turns['rps']:.1f}/s", f"{naive['rps']:.1f}/s", fmt(ratio(turns["rps"], naive["rps"]), "x")),
    ]  # fmt: skip
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]


def vllm_table(vllm: dict[str, Any], conns: list[int], args: argparse.Namespace) -> list[str]:
    """In front of a real vLLM: req/s direct and through each lifeguard, the ratio, the proxy's CPU."""
    planes = [("lifeguard", "lifeguard"), ("lifeguard-base", "baseline")]
    planes = [(path, plane) for path, plane in planes if any(f"{path}@{c}" in vllm for c in conns)]
    cols = ["real vLLM, max_tokens=1", "direct req/s"]
    for _, plane in planes:
        cols += [f"lifeguard {plane} req/s (÷ direct)", f"{plane}: proxy CPU/request", f"{plane}: p50 added"]
    cols += ["vLLM API server CPU/request (direct)", "lifeguard ÷ direct per run: median (min–max)", "target", ""]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in conns:
        direct = vllm.get(f"direct@{c}")
        if not direct:
            continue
        row = [f"{c} conn", fmt(direct["rps"])]
        for path, _ in planes:
            r = vllm.get(f"{path}@{c}")
            if not r:
                row += ["-", "-", "-"]
                continue
            row.append(f"{fmt(r['rps'])} ({fmt(ratio(r['rps'], direct['rps']), 'x')})")
            row += [fmt(r["cpu_us_per_req"], "us"), delta((r["p50_us"] - direct["p50_us"]) / 1000)]
        row.append(fmt(direct["vllm_api_cpu_us_per_req"], "us"))
        spread = vllm.get(f"spread@{c}") or {}
        low, high = fmt(spread.get("min"), "x"), fmt(spread.get("max"), "x")
        row.append(f"{fmt(spread['median'], 'x')} ({low}–{high})" if spread else "-")
        row += judge("vllm_rps_vs_direct", spread["median"]) if spread else NO_TARGET
        lines.append("| " + " | ".join(row) + " |")
    return lines


def build_table(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = fixed_rows(res.get("fixed", {}), args.conns) + outside_rows(res.get("outside", {}))
    rows += sse_rows(res.get("sse", {}), args.streams, args.sse_rate)
    rows += release_rows(res.get("release", {}))
    if res.get("hold"):
        rows += hold_rows(res["hold"], args.held)
    if res.get("lifecycle"):
        rows += lifecycle_rows(res["lifecycle"])
    if res.get("swap"):
        rows += swap_rows(res["swap"])
    header = head(args)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] if rows else []
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if res.get("mixed"):
        lines += ([""] if lines else []) + mixed_table(res["mixed"])
    if res.get("vllm"):
        lines += ([""] if lines else []) + vllm_table(res["vllm"], args.vllm_conns, args)
    return lines


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
