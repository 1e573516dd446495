"""Lifecycle calls as values: parsed and validated before anything is sent to vLLM.

vLLM validates little itself (an unknown or comma-joined wake tag is a silent no-op), so every parameter
is checked here and the call is rebuilt in the one form vLLM understands: tags as repeated `tags=`
parameters. A bad parameter is answered as vLLM 0.32's FastAPI validation answers it: 400, type
"Bad Request", `param` naming where it was ("query.mode", "body.method").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import BadParameter
from .worker_rpcs import RpcKind, WorkerRpc, classify

SLEEP_LEVELS = (0, 1, 2)
MODES = ("abort", "wait", "keep")
TAGS = ("weights", "kv_cache", "scheduling")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


@dataclass(frozen=True)
class LifecycleCall:
    """One validated lifecycle call. Equal calls coalesce: the second joins the first."""

    op: str
    query: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    level: int | None = None
    mode: str | None = None
    tags: tuple[str, ...] | None = None
    rpc_method: str | None = None
    # What a /collective_rpc does to the engine (proxy/lifecycle/worker_rpcs.py); None: a plain method.
    rpc: WorkerRpc | None = None

    @property
    def rpc_kind(self) -> RpcKind:
        return self.rpc.kind if self.rpc is not None else RpcKind.PLAIN

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...], bytes]:
        return (self.op, self.query, self.body)


def parse_call(op: str, query: Iterable[tuple[str, str]], body: bytes) -> LifecycleCall:
    """Build a `LifecycleCall` for `op` from the request's query pairs and body; raises BadParameter."""
    pairs = list(query)
    if op == "sleep":
        level = _level(_last(pairs, "level", "1"))
        mode = _mode(_last(pairs, "mode", "abort"))
        kept = [("level", str(level)), ("mode", mode)]
        # vLLM 0.34's KV-connector switch (serve/dev/sleep/api_router.py); older releases ignore the parameter.
        if (reset := _bool(pairs, "reset_connector")) is not None:
            kept.append(("reset_connector", "true" if reset else "false"))
        return LifecycleCall(op, tuple(kept), level=level, mode=mode)
    if op == "wake_up":
        tags = _tags([v for k, v in pairs if k == "tags"])
        return LifecycleCall(op, tuple(("tags", t) for t in tags or ()), tags=tags)
    if op == "pause":
        mode = _mode(_last(pairs, "mode", "abort"))
        sent: list[tuple[str, str]] = []
        if _bool(pairs, "wait_for_inflight_requests"):
            mode = "wait"  # vLLM: the deprecated flag forces wait mode
        sent.append(("mode", mode))
        clear_cache = _bool(pairs, "clear_cache")
        if clear_cache is not None:
            sent.append(("clear_cache", "true" if clear_cache else "false"))
        return LifecycleCall(op, tuple(sent), mode=mode)
    if op == "checkpoint_prepare":  # vLLM's default drain is `wait` (serve/checkpoint/api_router.py)
        mode = _mode(_last(pairs, "mode", "wait"))
        return LifecycleCall(op, (("mode", mode),), mode=mode)
    if op == "collective_rpc":
        rpc = classify(body)
        return LifecycleCall(op, tuple(pairs), body, rpc_method=rpc.method, rpc=rpc)
    return LifecycleCall(op, tuple(pairs), body)


def _last(pairs: list[tuple[str, str]], name: str, default: str) -> str:
    values = [v for k, v in pairs if k == name]
    return values[-1] if values else default


def _level(raw: str) -> int:
    try:
        level = int(raw)
    except ValueError:
        raise BadParameter(f"level must be an integer 0..2, got {raw!r}", param="query.level") from None
    if level not in SLEEP_LEVELS:
        raise BadParameter(f"level must be 0, 1 or 2, got {level}", param="query.level")
    return level


def _mode(raw: str) -> str:
    if raw not in MODES:
        raise BadParameter(f"mode must be one of abort, wait, keep; got {raw!r}", param="query.mode")
    return raw


def _tags(raw_values: list[str]) -> tuple[str, ...] | None:
    if not raw_values:
        return None
    tags: list[str] = []
    for raw in raw_values:
        for tag in (part.strip() for part in raw.split(",")):
            if tag not in TAGS:
                raise BadParameter(f"tags must be among weights, kv_cache, scheduling; got {tag!r}", param="query.tags")
            if tag not in tags:
                tags.append(tag)
    return tuple(tags)


def _bool(pairs: list[tuple[str, str]], name: str) -> bool | None:
    values = [v for k, v in pairs if k == name]
    if not values:
        return None
    raw = values[-1].lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise BadParameter(f"{name} must be true or false, got {values[-1]!r}", param=f"query.{name}")
