"""What differs between the vLLM releases the simulator can stand in for (`--vllm-version`).

Each difference was read in the released wheels (0.32.0 also measured on vLLM-for-CPU, docs/real-vllm.md); the
vLLM source files are named where a behaviour lives. The sleep routes are byte-identical in 0.32 and 0.33
(`vllm/entrypoints/serve/dev/sleep/api_router.py`); 0.34 adds `reset_connector` to /sleep and
/release_kv_cache_memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    version: str
    # `EngineCoreProc.pause_generation` (v1/engine/core.py): /pause?mode=abort|wait sets `reject_new_requests`, so
    # every new request ends at once with RequestError(code="engine_paused", retryable) until resume_scheduler
    # (a /resume, or a /wake_up that leaves nothing asleep). mode=keep and /sleep (pause_scheduler) still queue.
    pause_rejects: bool
    # serve/elastic_ep/middleware.py: /health and /is_scaling_elastic_ep pass the scaling gate (0.32 gated them too).
    health_passes_elastic_gate: bool
    # serve/elastic_ep/api_router.py: /is_scaling_elastic_ep also reports phase, epoch, error and the requested size.
    elastic_status_fields: bool
    # AsyncLLM._scale_elastic_ep: a scale-down in external-LB mode retires the ranks past the new size; a retired rank
    # answers /health 200 (check_health returns early) and 503 on everything else until its process is stopped.
    retires_ranks: bool
    # openai/decisions/api_router.py
    decisions_route: bool
    # serve/exception_handling/error_response.py: what a client is told when the engine core is dead.
    engine_dead_message: str
    # openai/completion/protocol.py, openai/chat_completion/protocol.py: `return_weight_versions` on a completion or
    # chat request gives each choice `weight_versions` spans (0.32 ignores the field: OpenAIBaseModel has
    # extra="allow"). /inference/v1/generate carries spans in every release.
    completion_spans: bool = False
    # serve/checkpoint/api_router.py, attached with --enable-sleep-mode (launchers/api_server/routers.py); the
    # checkpoint guards in v1/engine/core.py (sleep, wake_up, resume_scheduler).
    checkpoint: bool = False
    # serve/dev/sleep/api_router.py: /sleep and /release_kv_cache_memory take `reset_connector` (default true); before,
    # every cache-clearing pause reset the KV connector too (EngineCore._reset_caches).
    reset_connector_param: bool = False
    # serve/fault_tolerance/api_router.py: /v1/fault_tolerance/{apply,status} (request_id required) and the
    # EngineFaultedError refusal (v1/engine/async_llm.py check_admission). Older releases' /fault_tolerance routes
    # are not modelled.
    fault_tolerance: bool = False
    # device_allocator/cumem.py: a level-1 sleep's CPU backup is pinned (cudaHostRegister) and kept after the wake,
    # so host memory stays at about the weights' size from the first sleep on (0.33 frees it at the wake).
    keeps_host_backups: bool = False


ENGINE_DEAD_LOG_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_DEAD_CLIENT_MESSAGE = "The server had an error while processing your request."

V032 = Profile(
    version="0.32.0",
    pause_rejects=False,
    health_passes_elastic_gate=False,
    elastic_status_fields=False,
    retires_ranks=False,
    decisions_route=False,
    engine_dead_message=ENGINE_DEAD_LOG_MESSAGE,
)
V033 = replace(
    V032,
    version="0.33.0",
    pause_rejects=True,
    health_passes_elastic_gate=True,
    elastic_status_fields=True,
    retires_ranks=True,
    decisions_route=True,
    # EngineDeadError.CLIENT_MESSAGE (v1/engine/exceptions.py); str(exc) keeps the old text for the logs.
    engine_dead_message=ENGINE_DEAD_CLIENT_MESSAGE,
    completion_spans=True,
)
V034 = replace(
    V033, version="0.34.0", checkpoint=True, reset_connector_param=True, fault_tolerance=True, keeps_host_backups=True
)
PROFILES: dict[str, Profile] = {"0.32": V032, "0.33": V033, "0.34": V034}
# What `--vllm-version` is when not given. Not the newest (0.34): the proxy's own tests run against the default.
DEFAULT = "0.33"


def profile(version: str) -> Profile:
    """The profile of `version` ("0.32", "0.33", "0.34", or a full "0.34.0"); ValueError naming the known ones."""
    key = ".".join(version.split(".")[:2])
    if key not in PROFILES:
        raise ValueError(f"unknown vLLM version {version!r}: the simulator knows {', '.join(PROFILES)}")
    return PROFILES[key]
