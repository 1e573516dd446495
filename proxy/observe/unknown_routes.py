"""Requests to routes in no table (routes.RouteKind.UNKNOWN): counted by path template, logged once per path.

A route the proxy does not know is forwarded at once (`unknown_routes: pass`), so a new vLLM or trainer
route works through the proxy the day it appears; the count and the one log line make it visible, so it
can be classified on purpose (the `routes:` setting, or the table in proxy/front/route_table.py).
"""

from __future__ import annotations

import logging

from .metrics import EngineMetrics

log = logging.getLogger("lifeguard.http")

# Paths remembered to log each once; past this many, nothing more is logged (the metric still counts).
_LOGGED_PATHS = 1024


class UnknownRoutes:
    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._logged: set[tuple[str, str]] = set()

    def seen(self, method: str, path: str) -> None:
        template = path_template(path)
        self._metrics.unknown_route(method, template)
        key = (method, template)
        if key in self._logged or len(self._logged) >= _LOGGED_PATHS:
            return
        self._logged.add(key)
        log.warning(
            "forwarding %s %s: a route no table classifies (unknown_routes: pass)",
            method,
            template,
            extra={"event": "unknown_route", "method": method, "path": template},
        )


def path_template(path: str) -> str:
    """The label of an UNKNOWN path in metrics and logs: segments that look like ids (all digits, or long
    with digits: uuids, hashes) become `{id}`; version segments such as `v1` stay."""
    return "/".join("{id}" if _looks_like_id(segment) else segment for segment in path.split("/"))


def _looks_like_id(segment: str) -> bool:
    return segment.isdigit() or (len(segment) >= 8 and any(c.isdigit() for c in segment))
