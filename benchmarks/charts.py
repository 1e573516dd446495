"""The bench's figures as pictures: `charts.py BENCH.json --out docs/perf` (scripts/bench.sh runs it).

Reads the `--json` file run.py writes and draws, for every variant (direct, nginx, Envoy, vllm-router,
lifeguard, lifeguard of two engines, and the baseline checkout's lifeguard when one ran):
* `fixed-cpu.png`: proxy CPU µs per request, per connection count (the figure that holds on a shared box);
* `fixed-rps.png`: req/s, per connection count;
* `sse-latency.png`: SSE per-event latency p50 / p99 with the source paced, per stream count;
* `sse-cpu.png`: proxy CPU µs per SSE event with the source unpaced, per stream count;
* `vllm.png` (with the real-vLLM rows): req/s direct and through lifeguard, and the proxy's CPU per request.
A chart whose figures are missing is not drawn. Runs in the bench venv (matplotlib, headless Agg), not in the
project's venv; imports nothing from the rig.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

ORDER = ("direct", "nginx", "envoy", "vllm-router", "lifeguard", "lifeguard-2e", "lifeguard-base")
COLORS = {
    "direct": "#9e9e9e",
    "nginx": "#2e7d32",
    "envoy": "#6a1b9a",
    "vllm-router": "#ef6c00",
    "lifeguard": "#1565c0",
    "lifeguard-2e": "#42a5f5",
    "lifeguard-base": "#90caf9",
}


def label(path: str, args: dict[str, Any]) -> str:
    names = {"envoy": "Envoy", "lifeguard-2e": "lifeguard, 2 engines", "lifeguard-base": "lifeguard before"}
    return names.get(path, path)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def grouped(
    plt: Any,
    groups: list[str],
    series: dict[str, list[float]],
    names: dict[str, str],
    title: str,
    ylabel: str,
    out: Path,
    *,
    log: bool = False,
    fmt: str = "{:,.0f}",
) -> bool:
    """Grouped bars: one group per x label, one bar per series; each bar labelled with its value."""
    series = {k: v for k, v in series.items() if any(finite(x) for x in v)}
    if not series or not groups:
        return False
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.55 * len(groups) * len(series))), 4.2), dpi=110)
    width = 0.8 / len(series)
    for i, (key, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [v if finite(v) else 0.0 for v in values]
        light = key.endswith("/p50")  # a percentile pair: p50 pale, p99 solid, one color per variant
        color = COLORS.get(key.split("/")[0])
        bars = ax.bar(xs, heights, width, label=names[key], color=color, alpha=0.45 if light else 1.0)
        for bar, v in zip(bars, values, strict=True):
            if finite(v):
                ax.annotate(
                    fmt.format(v) if fmt != "short" else (f"{v:,.0f}" if v >= 10 else f"{v:.2g}"),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90 if len(series) > 4 else 0,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.25)
    ax.legend(fontsize=8, ncol=min(3, len(series)))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def fixed_charts(plt: Any, res: dict[str, Any], args: dict[str, Any], out: Path) -> list[Path]:
    fixed = res.get("fixed") or {}
    conns = sorted({int(k.split("@")[1]) for k in fixed})
    paths = [p for p in ORDER if any(f"{p}@{c}" in fixed for c in conns)]
    names = {p: label(p, args) for p in paths}
    groups = [f"{c} conn" for c in conns]

    def values(path: str, key: str) -> list[float]:
        return [fixed.get(f"{path}@{c}", {}).get(key, math.nan) for c in conns]

    written = []
    cpu = {p: values(p, "cpu_us_per_req") for p in paths if p != "direct"}
    title = "Proxy CPU per request (µs, lower is better; non-streaming POST /v1/completions, wrk -t1)"
    if grouped(plt, groups, cpu, names, title, "CPU µs / request", out / "fixed-cpu.png", log=True):
        written.append(out / "fixed-cpu.png")
    rps = {p: values(p, "rps") for p in paths}
    title = "Throughput (req/s, higher is better; loopback, the load generator on the same cores)"
    if grouped(plt, groups, rps, names, title, "req/s", out / "fixed-rps.png", log=True):
        written.append(out / "fixed-rps.png")
    return written


def sse_charts(plt: Any, res: dict[str, Any], args: dict[str, Any], out: Path) -> list[Path]:
    sse = res.get("sse") or {}
    streams = sorted({int(k.split("@")[1]) for k in sse if not k.endswith("max")})
    paths = [p for p in ORDER if any(f"{p}@{s}" in sse for s in streams)]
    written = []
    names: dict[str, str] = {}
    lat: dict[str, list[float]] = {}
    for p in paths:
        for q in ("p50", "p99"):
            names[f"{p}/{q}"] = f"{label(p, args)} {q}"
            lat[f"{p}/{q}"] = [sse.get(f"{p}@{s}", {}).get(f"{q}_us", math.nan) / 1000 for s in streams]
    groups = [f"{s} streams" for s in streams]
    rate = args.get("sse_rate", 0)
    title = f"SSE per-event latency, source paced at {rate:,.0f} events/s in all (ms, lower is better)"
    if grouped(plt, groups, lat, names, title, "ms (log)", out / "sse-latency.png", log=True, fmt="short"):
        written.append(out / "sse-latency.png")
    cpu = {p: [sse.get(f"{p}@{s}max", {}).get("cpu_us_per_event", math.nan) for s in streams] for p in paths}
    cpu.pop("direct", None)
    title = "Proxy CPU per SSE event, source unpaced (µs, lower is better)"
    names = {p: label(p, args) for p in paths}
    if grouped(plt, groups, cpu, names, title, "CPU µs / event", out / "sse-cpu.png", fmt="{:.1f}"):
        written.append(out / "sse-cpu.png")
    return written


def vllm_chart(plt: Any, res: dict[str, Any], args: dict[str, Any], out: Path) -> list[Path]:
    vllm = res.get("vllm") or {}
    conns = sorted({int(k.split("@")[1]) for k in vllm})
    paths = [p for p in ORDER if any(f"{p}@{c}" in vllm for c in conns)]
    if not conns or "direct" not in paths:
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        xs = [g + (i - (len(paths) - 1) / 2) * width for g in range(len(conns))]
        rps = [vllm.get(f"{p}@{c}", {}).get("rps", 0.0) for c in conns]
        left.bar(xs, rps, width, label=label(p, args), color=COLORS[p])
        if p != "direct":
            cpu = [vllm.get(f"{p}@{c}", {}).get("cpu_us_per_req", 0.0) for c in conns]
            right.bar(xs, cpu, width, label=label(p, args), color=COLORS[p])
    direct_cpu = [vllm.get(f"direct@{c}", {}).get("vllm_api_cpu_us_per_req", 0.0) for c in conns]
    right.plot(range(len(conns)), direct_cpu, "k--o", label="vLLM API server (direct)", markersize=4)
    for ax, title, ylabel in (
        (left, "Real vLLM-for-CPU, max_tokens=1: req/s", "req/s"),
        (right, "CPU per request (µs, idle loops included)", "CPU µs / request"),
    ):
        ax.set_xticks(range(len(conns)), [f"{c} conn" for c in conns])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "vllm.png")
    plt.close(fig)
    return [out / "vllm.png"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="the file run.py --json wrote")
    parser.add_argument("--out", default="docs/perf", help="folder for the PNGs")
    opts = parser.parse_args()
    matplotlib = importlib.import_module("matplotlib")  # the bench venv's; not in the project's venv
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    res = json.loads(Path(opts.json).read_text())
    args = res.get("args", {})
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    written = fixed_charts(plt, res, args, out) + sse_charts(plt, res, args, out) + vllm_chart(plt, res, args, out)
    for path in written:
        print(f"charts: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
