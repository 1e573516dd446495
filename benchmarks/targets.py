"""The speed targets of docs/performance.md (issues 21, 25, 30 and 39), in one table: what the target column says
and when it is met.

Each is judged on one figure that report.py derives from the measurements (the key below). A figure
that was not measured (missing, nan, infinite) is neither met nor missed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    text: str
    met: Callable[[float], bool]


TARGETS: dict[str, Target] = {
    # req/s through lifeguard ÷ req/s through nginx, 64 connections (issue 39; issue 30 asked 0.5×, issue 21 0.6×)
    "rps_vs_nginx@64": Target("≥ 0.7× nginx", lambda ratio: ratio >= 0.7),
    # lifeguard's CPU µs per request ÷ nginx's, 64 connections, the guard on (issue 39; issue 30 asked 2×)
    "cpu_vs_nginx@64": Target("≤ 1.5× nginx", lambda ratio: ratio <= 1.5),
    # the same two for the proxy of two engines (routed by model)
    "rps_2e_vs_nginx@64": Target("≥ 0.5× nginx", lambda ratio: ratio >= 0.5),
    "cpu_2e_vs_nginx@64": Target("≤ 2× nginx", lambda ratio: ratio <= 2),
    # issue 39's outside measurement (outside.py): wrk -t1 -c64, one fixed body, process-tree CPU; lifeguard ÷ nginx,
    # the median of the per-repetition ratios
    "outside_cpu_vs_nginx": Target("≤ 1.5× nginx", lambda ratio: ratio <= 1.5),
    "outside_rps_vs_nginx": Target("≥ 0.7× nginx", lambda ratio: ratio >= 0.7),
    # lifeguard's CPU µs per request ÷ Envoy's, 64 connections
    "cpu_vs_envoy@64": Target("≤ Envoy's", lambda ratio: ratio <= 1),
    # two engines behind one proxy (routed by model) ÷ one engine, CPU per request, 64 connections (issue 39)
    "cpu_2e_vs_1e@64": Target("≤ 1.1× one engine", lambda ratio: ratio <= 1.1),
    # this checkout ÷ the baseline checkout (--baseline-src), CPU per request, 64 connections: no slower
    "cpu_vs_baseline@64": Target("within ±10% of the baseline or below", lambda ratio: ratio <= 1.1),
    # ms lifeguard adds over nginx
    "p50_over_nginx_ms@1": Target("+≤ 0.1 ms over nginx", lambda added: added <= 0.1),
    "p99_over_nginx_ms@256": Target("+≤ 2 ms over nginx", lambda added: added <= 2),
    # SSE events/s relayed with the source unpaced; lifeguard's CPU per event ÷ nginx's (the median; at 512 streams
    # and more the worst repetition, issue 39); a burst of 512
    # streams: lifeguard's time until every one delivers ÷ nginx's, in the worst repetition
    "sse_events_per_s": Target("≥ 50,000/s", lambda rate: rate >= 50_000),
    "sse_cpu_vs_nginx": Target("≤ 1.2× nginx (512 and 2,048 streams: in every run)", lambda ratio: ratio <= 1.2),
    "sse_burst_vs_nginx": Target("≤ 2× nginx in every run", lambda ratio: ratio <= 2),
    # the release burst (release.py): lifeguard's resume's 200 → last stream's first byte ÷ nginx's send → last first
    # byte of as many fresh streams, the worst repetition; the share of held streams answered 200 to [DONE], no 5xx
    "release_burst_vs_nginx": Target("≤ 1.5× nginx in every run", lambda ratio: ratio <= 1.5),
    "release_answered_share": Target("all, no 5xx", lambda share: share >= 1),
    # in front of a real vLLM: req/s through lifeguard ÷ req/s direct, the median of the interleaved runs
    "vllm_rps_vs_direct": Target("≥ 0.95× direct (median)", lambda ratio: ratio >= 0.95),
    # held requests: wake end → first forwarded; drain rate ÷ steady rate (0 unless all answered 200);
    # the share answered 200; RSS per held request
    "hold_first_ms": Target("≤ 5 ms", lambda ms: ms <= 5),
    "hold_drain_vs_steady": Target("≥ steady", lambda ratio: ratio >= 1),
    "hold_answered_share": Target("all", lambda share: share >= 1),
    "hold_bytes_per_request": Target("≤ 2 KB", lambda size: size <= 2048),
    # ms a sleep or a wake through lifeguard takes beyond the same call direct
    "lifecycle_added_ms": Target("+≤ 50 ms", lambda added: added <= 50),
    # ms a swap (request for a sleeping model → first byte) takes beyond the engines' own sleep + wake
    "swap_added_ms": Target("+≤ 50 ms", lambda added: added <= 50),
}


def measured(value: object) -> bool:
    """A figure that was measured (not missing, not nan, not infinite)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def judge(key: str, value: float) -> list[str]:
    """The target and verdict cells of a row judged by TARGETS[key]."""
    target = TARGETS[key]
    if not measured(value):
        return [target.text, ""]
    return [target.text, "met" if target.met(value) else "**missed**"]
