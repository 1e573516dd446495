"""What a `/collective_rpc` method does to the engine, read from its name and JSON body (no I/O).

vLLM dispatches `/collective_rpc` by name, so the proxy knows a method only from the trainers' worker extensions.
Most leave the lifecycle alone (still serialized with it). These do not: weight reloads and writes (settings
`weight_reload_rpc_methods`, `weight_update_rpc_methods`); SkyRL 0.4.0's `skyrl_sleep_for_weight_sync` and
`skyrl_wake_for_weight_sync` (a sleep vLLM's own flags never see); `skyrl_set_lora_receive_target` (the next round
builds a LoRA adapter, not base weights). docs/design.md.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from ..errors import BadParameter

SLEEP_FOR_WEIGHT_SYNC = "skyrl_sleep_for_weight_sync"
WAKE_FOR_WEIGHT_SYNC = "skyrl_wake_for_weight_sync"
ARM_ADAPTER_ROUND = "skyrl_set_lora_receive_target"
# The pools SkyRL's allocator sleep and wake name (vLLM's CuMemAllocator tags).
_POOLS = ("weights", "kv_cache")


class RpcKind(enum.Enum):
    PLAIN = "plain"  # or a weight load / write of the settings' lists (rules.judge, weight_updates.py)
    SLEEP_FOR_SYNC = "sleep_for_sync"  # frees pools behind vLLM's back
    WAKE_FOR_SYNC = "wake_for_sync"  # maps those pools back
    ARM_ADAPTER_ROUND = "arm_adapter_round"  # the next weight-update round builds a LoRA adapter


@dataclass(frozen=True)
class WorkerRpc:
    method: str
    kind: RpcKind
    # SLEEP_FOR_SYNC: the pools it frees; WAKE_FOR_SYNC: the pools it maps back.
    tags: frozenset[str] = frozenset()
    # SLEEP_FOR_SYNC: whether the KV cache is kept in CPU memory (else discarded).
    offload_kv: bool = True


def classify(body: bytes) -> WorkerRpc:
    """The RPC a `/collective_rpc` body asks for; raises BadParameter (vLLM answers 400 itself for the first
    two, and the SkyRL methods' own checks fail inside the workers with a 500)."""
    try:
        payload = json.loads(body or b"null")
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's parser goes
        raise BadParameter("collective_rpc needs a JSON body", param="body") from None
    method = payload.get("method") if isinstance(payload, dict) else None
    if not isinstance(method, str) or not method:
        raise BadParameter("collective_rpc needs a string 'method' in its JSON body", param="body.method")
    assert isinstance(payload, dict)
    kwargs = payload.get("kwargs") or {}
    takes_kwargs = method in (SLEEP_FOR_WEIGHT_SYNC, WAKE_FOR_WEIGHT_SYNC)
    if takes_kwargs and (payload.get("args") or not isinstance(kwargs, dict)):
        raise BadParameter(f"{method} takes its arguments as 'kwargs' (an object)", param="body.kwargs")
    if method == SLEEP_FOR_WEIGHT_SYNC:
        offload_kv = kwargs.get("offload_kv", True)
        if not isinstance(offload_kv, bool):
            raise BadParameter(f"offload_kv must be true or false, got {offload_kv!r}", param="body.kwargs.offload_kv")
        return WorkerRpc(method, RpcKind.SLEEP_FOR_SYNC, frozenset(_POOLS), offload_kv)
    if method == WAKE_FOR_WEIGHT_SYNC:
        return WorkerRpc(method, RpcKind.WAKE_FOR_SYNC, _wake_tags(kwargs.get("tags")))
    if method == ARM_ADAPTER_ROUND:
        return WorkerRpc(method, RpcKind.ARM_ADAPTER_ROUND)
    return WorkerRpc(method, RpcKind.PLAIN)


def _wake_tags(raw: Any) -> frozenset[str]:
    """SkyRL wakes every pool for `tags: null`, else the ones named."""
    if raw is None:
        return frozenset(_POOLS)
    if not isinstance(raw, list) or not raw or any(tag not in _POOLS for tag in raw):
        raise BadParameter(f"tags must be a list among weights, kv_cache; got {raw!r}", param="body.kwargs.tags")
    return frozenset(raw)


def noop_reply() -> dict[str, Any]:
    """vLLM 0.32's answer to a worker method that returned None on its one worker (`{"results": [null]}`)."""
    return {"results": [None]}
