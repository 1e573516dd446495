"""The one table that says how each (method, path) is treated.

Paths are target.py's decoded, canonical ones. Every route of vLLM 0.32 and of the supported trainers' frameworks is
listed on purpose (`make test-vllm-routes` scans the newest wheel). Kinds: LIFECYCLE (coordinated and verified),
AT_ONCE and SERIALIZED control calls, NEVER_GATED reads, INFERENCE (gated), UNKNOWN (`unknown_routes` decides).
What each kind means: docs/reference/routes.md and docs/design.md.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class RouteKind(enum.Enum):
    LIFECYCLE = "lifecycle"
    AT_ONCE = "at_once"
    SERIALIZED = "serialized"
    NEVER_GATED = "never_gated"
    INFERENCE = "inference"
    UNKNOWN = "unknown"


#: What each kind means for a request (docs/reference/routes.md).
KIND_MEANINGS: Mapping[RouteKind, str] = {
    RouteKind.LIFECYCLE: "validated, serialized (one at a time per engine) and verified by the engine's coordinator; "
    "admin token",
    RouteKind.AT_ONCE: "control calls forwarded at once while the engine is up, never queued behind a lifecycle call "
    "(a trainer's NCCL side runs beside them); admin token; refused while FAILED",
    RouteKind.SERIALIZED: "control calls that touch weights or memory: they wait for a lifecycle transition in "
    "progress to end, then run at once; never held by a sleep or a pause; admin token; refused while FAILED",
    RouteKind.NEVER_GATED: "read-only, health and tokenizer-only routes: always forwarded, in every state",
    RouteKind.INFERENCE: "held (or refused, by `on_sleeping` and the limits) unless the engine is RUNNING",
    RouteKind.UNKNOWN: "in no table: GET, HEAD and OPTIONS are read-only; any other method follows `unknown_routes` "
    "(`pass`: forwarded at once, admin token, counted in lifeguard_unknown_route_requests_total; `hold`: as "
    "inference)",
}

#: Classes an operator may add paths to with `routes:` in the settings (UNKNOWN and LIFECYCLE are not choices).
CONFIGURABLE_KINDS: Mapping[str, RouteKind] = {
    "inference": RouteKind.INFERENCE,
    "at_once": RouteKind.AT_ONCE,
    "serialized": RouteKind.SERIALIZED,
    "never_gated": RouteKind.NEVER_GATED,
}

#: Lifecycle paths and the coordinator operation each one is.
LIFECYCLE_PATHS: dict[str, str] = {
    "/sleep": "sleep",
    "/wake_up": "wake_up",
    "/pause": "pause",
    "/resume": "resume",
    "/start_weight_update": "start_weight_update",
    "/start_draft_weight_update": "start_draft_weight_update",
    "/update_weights": "update_weights",
    "/finish_weight_update": "finish_weight_update",
    "/collective_rpc": "collective_rpc",
    "/release_kv_cache_memory": "release_kv_cache_memory",
    # vLLM 0.34 (serve/checkpoint/api_router.py): drain and release memory for a process checkpoint, and back;
    # served whenever sleep mode is on, without dev mode too.
    "/checkpoint/prepare": "checkpoint_prepare",
    "/checkpoint/restore": "checkpoint_restore",
}

_R, _P, _RP = ("GET", "HEAD"), ("POST",), ("GET", "HEAD", "POST")
ANY_METHOD = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# vLLM's routes as (methods, path template, kind): 0.32's (vllm/entrypoints/**/api_router.py, built with every
# flag on by scripts/vllm/vllm_routes.py) and those of every newer release, read from its wheel by the AST scan of
# scripts/vllm/route_scan.py (`make test-vllm-routes`).
VLLM_ROUTES: tuple[tuple[tuple[str, ...], str, RouteKind], ...] = (
    *((_P, path, RouteKind.LIFECYCLE) for path in LIFECYCLE_PATHS),
    # serve/dev/cache, rl/online, serve/profile, scale_out: control calls that never wait
    (_P, "/init_weight_transfer_engine", RouteKind.AT_ONCE),
    (_P, "/shutdown_weight_transfer_engine", RouteKind.AT_ONCE),
    (_P, "/update_weight_version", RouteKind.AT_ONCE),
    (_P, "/abort_requests", RouteKind.AT_ONCE),
    (_P, "/inference/v1/abort_requests", RouteKind.AT_ONCE),
    (_P, "/reset_prefix_cache", RouteKind.AT_ONCE),
    (_P, "/reset_mm_cache", RouteKind.AT_ONCE),
    (_P, "/reset_encoder_cache", RouteKind.AT_ONCE),
    (_P, "/start_profile", RouteKind.AT_ONCE),
    (_P, "/stop_profile", RouteKind.AT_ONCE),
    # serve/lora (VLLM_ALLOW_RUNTIME_LORA_UPDATING), sagemaker adapters, elastic EP, weight checker,
    # fault tolerance: they change or read the weights or the engine's memory
    (_P, "/v1/load_lora_adapter", RouteKind.SERIALIZED),
    (_P, "/v1/unload_lora_adapter", RouteKind.SERIALIZED),
    (_P, "/adapters", RouteKind.SERIALIZED),
    (("DELETE",), "/adapters/{adapter_name}", RouteKind.SERIALIZED),
    (_P, "/scale_elastic_ep", RouteKind.SERIALIZED),
    (_P, "/weight_checker", RouteKind.SERIALIZED),
    (_P, "/fault_tolerance/apply", RouteKind.SERIALIZED),
    (_P, "/v1/fault_tolerance/apply", RouteKind.SERIALIZED),  # vLLM 0.34's path for it
    # read-only, health, metrics, docs
    (_R, "/health", RouteKind.NEVER_GATED),
    (_RP, "/ping", RouteKind.NEVER_GATED),
    (("*",), "/metrics", RouteKind.NEVER_GATED),
    (_R, "/version", RouteKind.NEVER_GATED),
    (_R, "/load", RouteKind.NEVER_GATED),
    (_R, "/v1/models", RouteKind.NEVER_GATED),
    (_R, "/is_sleeping", RouteKind.NEVER_GATED),
    (_R, "/is_paused", RouteKind.NEVER_GATED),
    (_R, "/server_info", RouteKind.NEVER_GATED),
    (_R, "/weight_info", RouteKind.NEVER_GATED),  # answered with the vouched weight version (Engine.plan_read)
    (_R, "/get_world_size", RouteKind.NEVER_GATED),
    (_R, "/kv_event_sources", RouteKind.NEVER_GATED),
    (_R, "/tokenizer_info", RouteKind.NEVER_GATED),
    (_R, "/fault_tolerance/status", RouteKind.NEVER_GATED),
    (_R, "/v1/fault_tolerance/status", RouteKind.NEVER_GATED),
    (_R, "/checkpoint/status", RouteKind.NEVER_GATED),
    (_P, "/is_scaling_elastic_ep", RouteKind.NEVER_GATED),
    (_R, "/openapi.json", RouteKind.NEVER_GATED),
    # --enable-offline-docs: the Swagger UI's files (serve/instrumentator/offline_docs.py)
    (("*",), "/static", RouteKind.NEVER_GATED),
    (("*",), "/static/*", RouteKind.NEVER_GATED),
    # the data-parallel supervisor's own app (launchers/dp_supervisor.py), in front of its API servers
    (_R, "/ready", RouteKind.NEVER_GATED),
    (_R, "/readyz", RouteKind.NEVER_GATED),
    (_R, "/docs", RouteKind.NEVER_GATED),
    (_R, "/docs/oauth2-redirect", RouteKind.NEVER_GATED),
    (_R, "/redoc", RouteKind.NEVER_GATED),
    (_R, "/v1/responses/{response_id}", RouteKind.NEVER_GATED),
    # the inference client's own cancel of a background response: holding it would only delay it
    (_P, "/v1/responses/{response_id}/cancel", RouteKind.NEVER_GATED),
    # tokenizer and renderer only: the engine is not involved (SkyRL renders chats over HTTP)
    (_P, "/tokenize", RouteKind.NEVER_GATED),
    (_P, "/detokenize", RouteKind.NEVER_GATED),
    (_P, "/v1/messages/count_tokens", RouteKind.NEVER_GATED),
    (_P, "/v1/completions/render", RouteKind.NEVER_GATED),
    (_P, "/v1/chat/completions/render", RouteKind.NEVER_GATED),
    (_P, "/v1/responses/render", RouteKind.NEVER_GATED),
    (_P, "/v1/messages/render", RouteKind.NEVER_GATED),
    (_P, "/v1/completions/derender", RouteKind.NEVER_GATED),
    (_P, "/v1/chat/completions/derender", RouteKind.NEVER_GATED),
    (_P, "/cohere/v2/chat/render", RouteKind.NEVER_GATED),
    # inference
    *(
        (_P, path, RouteKind.INFERENCE)
        for path in (
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/chat/completions/batch",
            "/v1/responses",
            "/v1/messages",
            "/v1/systemone",
            # vLLM 0.33: label reads on the engine (openai/decisions/api_router.py), so it waits like a completion
            "/v1/decisions",
            # with the cohere SDK installed (cohere/api_router.py)
            "/cohere/v2/chat",
            "/v1/embeddings",
            "/v2/embed",
            "/v1/audio/transcriptions",
            "/v1/audio/translations",
            "/inference/v1/generate",
            "/invocations",
            "/generative_scoring",
            "/pooling",
            "/classify",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
        )
    ),
)

# Routes of the trainers' own vLLM server wrappers, read from their client code (docs/guides/).
FRAMEWORK_ROUTES: tuple[tuple[tuple[str, ...], str, RouteKind], ...] = (
    # SkyRL (skyrl/backends/skyrl_train/inference_servers/): LoRA sync happens inside its weight sync,
    # between wake_up?tags=weights and wake_up?tags=kv_cache; R3 generation is inference. /fetch_weights
    # (0.4.0, vllm_server_actor.py) downloads a checkpoint delta and applies it to the workers' checkpoint
    # files on disk (weight_sync/delta/): no GPU memory, no weights in use. SkyRL sends it before its pause
    # so the download overlaps live generation; it may run paused or asleep too, so it never waits.
    (_P, "/skyrl/v1/load_lora_adapter", RouteKind.SERIALIZED),
    (_P, "/skyrl/v1/generate", RouteKind.INFERENCE),
    (_P, "/fetch_weights", RouteKind.AT_ONCE),
    # AReaL (areal/engine/vllm_ext/areal_vllm_server.py): its own pause/continue and weight routes, sent
    # while it keeps the engine paused; each must pass or the trainer deadlocks.
    (_P, "/areal_{name}", RouteKind.AT_ONCE),
    # prime-rl (src/prime_rl/inference/vllm/server.py): admin routes of its server wrapper.
    (_P, "/init_broadcaster", RouteKind.AT_ONCE),
    (_P, "/load_lora_adapter", RouteKind.SERIALIZED),
    (_R, "/liveness", RouteKind.NEVER_GATED),
)


@dataclass(frozen=True)
class Route:
    kind: RouteKind
    template: str


class RouteTable:
    """Looks up the kind of a (method, decoded path); built once from the tables and the settings."""

    def __init__(
        self,
        entries: Iterable[tuple[Iterable[str], str, RouteKind]],
        *,
        unknown_pass: bool = True,
    ) -> None:
        self._exact: dict[tuple[str, str], Route] = {}
        self._templates: list[tuple[re.Pattern[str], frozenset[str], Route]] = []
        self._unknown_pass = unknown_pass
        for methods, template, kind in entries:
            methods = frozenset(methods)
            route = Route(kind, template)
            if "{" in template or template.endswith("/*"):
                self._templates.append((_compile(template), methods, route))
                continue
            for method in methods:
                self._exact.setdefault((method, template), route)

    def lookup(self, method: str, path: str) -> Route | None:
        """The explicit entry for (method, path), or None; a trailing slash is looked up without it, as
        vLLM's router redirects `/x/` to `/x`."""
        p = path.rstrip("/") or "/"
        route = self._exact.get((method, p)) or self._exact.get(("*", p))
        if route is not None:
            return route
        for pattern, methods, candidate in self._templates:
            if (method in methods or "*" in methods) and pattern.fullmatch(p):
                return candidate
        return None

    def classify(self, method: str, path: str) -> RouteKind:
        route = self.lookup(method, path)
        if route is not None:
            return route.kind
        if method in ("GET", "HEAD", "OPTIONS"):
            return RouteKind.NEVER_GATED
        # A lifecycle path with another method (GET /sleep): vLLM answers 405 and nothing changes.
        if (path.rstrip("/") or "/") in LIFECYCLE_PATHS:
            return RouteKind.NEVER_GATED
        return RouteKind.UNKNOWN if self._unknown_pass else RouteKind.INFERENCE


def build_table(extra: Iterable[tuple[str, Iterable[str]]] = (), *, unknown_routes: str = "pass") -> RouteTable:
    """The table of vLLM's and the trainers' routes. `extra`, the `routes:` setting as (class, paths) pairs,
    comes first, so an operator may reclassify a path for every method; lifecycle paths stay with the
    coordinator whatever it says."""
    declared: list[tuple[Iterable[str], str, RouteKind]] = []
    for name, paths in extra:
        kind = CONFIGURABLE_KINDS[name]
        declared.extend((ANY_METHOD, path, kind) for path in paths if (path.rstrip("/") or "/") not in LIFECYCLE_PATHS)
    lifecycle = [entry for entry in VLLM_ROUTES if entry[2] is RouteKind.LIFECYCLE]
    return RouteTable([*lifecycle, *declared, *VLLM_ROUTES, *FRAMEWORK_ROUTES], unknown_pass=unknown_routes == "pass")


def _compile(template: str) -> re.Pattern[str]:
    if template.endswith("/*"):
        return re.compile(re.escape(template[:-1]) + ".+")
    parts = re.split(r"\{[^/{}]+\}", template)
    return re.compile("[^/]+".join(re.escape(part) for part in parts))
