"""Where a request goes, decided once from its method and target: which engine, and which route-table row.

`/engines/<name>/...` is that engine (404 `unknown_engine` for a name none has); `/lifeguard/...` is the proxy's
own. Anything else goes to the only engine; with several, inference and reads go to the engine serving the body's
`"model"` (model_directory.py) and any other route must name its engine (400 `engine_not_chosen`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import EngineNotChosen, UnknownEngine
from ..lifecycle.engine import Engine
from .route_table import LIFECYCLE_PATHS, RouteKind, RouteTable
from .target import below_mount, canonical_target

ENGINES_PREFIX = "/engines"
OWN_PREFIX = "/lifeguard"
#: Kinds that take the admin token when one is set (proxy/front/admin.py).
GUARDED = frozenset({RouteKind.LIFECYCLE, RouteKind.AT_ONCE, RouteKind.SERIALIZED, RouteKind.UNKNOWN})
_DECIDED_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class Route:
    """`kind` None: the proxy answers itself. `engine` None: about every engine, or (`by_model`) the one its
    body's model names. `target`: the raw origin-form target the engine is sent (the mount taken off)."""

    kind: RouteKind | None
    engine: Engine | None
    target: bytes
    path: str
    query: str
    by_model: bool = False
    op: str | None = None  # the lifecycle operation, for kind LIFECYCLE


class Router:
    def __init__(self, engines: Mapping[str, Engine], table: RouteTable) -> None:
        self._engines = engines
        self._only = next(iter(engines.values())) if len(engines) == 1 else None
        self._table = table
        # Traffic uses a handful of targets: decisions are kept (bounded, as query strings make them unbounded).
        self._decided: dict[tuple[bytes, bytes], Route] = {}

    def route(self, method: bytes, url: bytes) -> Route:
        """Raises BadTarget (a target read two ways) or UnknownEngine."""
        key = (method, url)
        route = self._decided.get(key)
        if route is None:
            route = self._decide(method.decode("latin-1"), url.decode("latin-1"))
            if len(self._decided) < _DECIDED_CACHE_SIZE:
                self._decided[key] = route
        return route

    def _decide(self, method: str, url: str) -> Route:
        target = canonical_target(url)
        engine = self._only
        mounted = target.path == ENGINES_PREFIX or target.path.startswith(ENGINES_PREFIX + "/")
        if mounted:
            name = target.path[len(ENGINES_PREFIX) + 1 :].split("/", 1)[0]
            found = self._engines.get(name)
            if found is None:
                raise UnknownEngine(f"no engine is named {name!r} here; the engines are: {', '.join(self._engines)}")
            engine = found
            target = below_mount(target, f"{ENGINES_PREFIX}/{name}")
        raw = target.raw.encode("latin-1")
        if target.path == OWN_PREFIX or target.path.startswith(OWN_PREFIX + "/"):
            return Route(None, engine if mounted else None, raw, target.path, target.query)
        kind = self._table.classify(method, target.path)
        if engine is None and target.path == "/v1/models" and method in ("GET", "HEAD"):
            return Route(None, None, raw, target.path, target.query)
        by_model = engine is None and kind in (RouteKind.INFERENCE, RouteKind.NEVER_GATED)
        op = LIFECYCLE_PATHS[target.path.rstrip("/")] if kind is RouteKind.LIFECYCLE else None
        return Route(kind, engine, raw, target.path, target.query, by_model, op)

    def not_chosen(self, route: Route) -> EngineNotChosen:
        """The error of a request that several engines could take and that does not say which."""
        where = ", ".join(f"{ENGINES_PREFIX}/{name}{route.path}" for name in self._engines)
        if route.kind is RouteKind.LIFECYCLE:
            return EngineNotChosen(f"several engines are guarded here: send {route.path} to one of them: {where}")
        return EngineNotChosen(
            f"several engines are guarded here and this request names no served model: send it to one of {where}"
        )


def model_of(body: bytes) -> str | None:
    """The `"model"` of a JSON request body, if it names one. On the path of every request to a proxy of
    several engines: `raw_decode` of the text skips what `json.loads` adds (encoding detection, the
    trailing-whitespace scan), about a third of the cost; what follows the object is vLLM's to refuse."""
    if not body:
        return None
    try:
        text = body.decode()
        payload, _ = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) and model else None


_DECODER = json.JSONDecoder()
