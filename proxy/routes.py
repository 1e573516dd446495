"""The one table that says how each vLLM path is treated. Paths not listed are forwarded unchanged.

* LIFECYCLE: validated, serialized and verified by the coordinator.
* AT_ONCE: control calls forwarded immediately while the engine is up; they must never queue behind
  a lifecycle call (the trainer's NCCL side runs concurrently with them).
* NEVER_GATED: read-only and health routes; always forwarded, in every state.
* INFERENCE: held or refused by the gate unless the engine is RUNNING.
Unknown paths: GET/HEAD are read-only and pass; other methods are treated as inference (held while the
engine is not ready), which is the safe side for framework routes such as `/skyrl/v1/*`.
"""

from __future__ import annotations

import enum


class RouteKind(enum.Enum):
    LIFECYCLE = "lifecycle"
    AT_ONCE = "at_once"
    NEVER_GATED = "never_gated"
    INFERENCE = "inference"


LIFECYCLE_PATHS: dict[str, str] = {
    "/sleep": "sleep",
    "/wake_up": "wake_up",
    "/pause": "pause",
    "/resume": "resume",
    "/start_weight_update": "start_weight_update",
    "/update_weights": "update_weights",
    "/finish_weight_update": "finish_weight_update",
    "/collective_rpc": "collective_rpc",
}

AT_ONCE_PATHS = frozenset(
    {
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_draft_weight_update",
        "/abort_requests",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/update_weight_version",
    }
)

NEVER_GATED_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/metrics",
        "/version",
        "/v1/models",
        "/is_sleeping",
        "/is_paused",
        "/load",
        "/tokenize",
        "/detokenize",
        "/server_info",
        "/weight_info",
        "/get_world_size",
        "/openapi.json",
        "/is_scaling_elastic_ep",
    }
)

INFERENCE_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/inference/v1/generate",
        "/invocations",
    }
)


def normalise(path: str) -> str:
    """The path used for classification only; requests are forwarded with the path as sent."""
    return path.rstrip("/") or "/"


def classify(method: str, path: str) -> RouteKind:
    p = normalise(path)
    if p in LIFECYCLE_PATHS and method == "POST":
        return RouteKind.LIFECYCLE
    if p in AT_ONCE_PATHS:
        return RouteKind.AT_ONCE
    if p in NEVER_GATED_PATHS:
        return RouteKind.NEVER_GATED
    if p in INFERENCE_PATHS:
        return RouteKind.INFERENCE
    if method in ("GET", "HEAD", "OPTIONS"):
        return RouteKind.NEVER_GATED
    return RouteKind.INFERENCE
