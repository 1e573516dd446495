"""The prefix cache after a weight change: old-weight KV blocks must not serve a request admitted afterwards.

vLLM can reset its prefix cache only while no block is held (`BlockPool.reset_prefix_cache`): with requests
kept by a `/pause?mode=keep`, `/reset_prefix_cache` answers 200 `{"success": false}`. Until a reset succeeds,
the engine's record holds a `Partition`: a fresh salt that every admitted inference body carries in
`cache_salt` (vLLM hashes it into a request's first block), so no new request can match a block computed
before the change. docs/verification.md ("The prefix cache after a weight change") says why and what it costs.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

#: The routes whose request body takes `cache_salt` (vLLM 0.32: openai completion, chat_completion and
#: responses protocols, anthropic messages, scale_out's token-in-token-out generate, the pooling requests).
SALTED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/inference/v1/generate",
        "/v1/embeddings",
        "/pooling",
        "/classify",
    }
)
RESET_PATH = "/reset_prefix_cache"
LORA_LOAD_PATH = "/v1/load_lora_adapter"
# vLLM's validate_cache_salt (entrypoints/generate/base/protocol.py): non-empty, at most 128 characters, none of these.
_MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\x00")
#: The header on every `/reset_prefix_cache` answer: whether blocks computed by older weights may still be cached.
HEADER = b"X-Lifeguard-Prefix-Cache"


@dataclass(frozen=True)
class Partition:
    """Blocks computed by weights older than the change at `since` may still be in vLLM's prefix cache; requests
    admitted since carry `salt`."""

    salt: str
    since: float
    reason: str

    @classmethod
    def after(cls, reason: str) -> Partition:
        return cls(salt="lifeguard-" + secrets.token_hex(8), since=time.time(), reason=reason)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> Partition | None:
        if not isinstance(raw, dict):
            return None
        return cls(salt=str(raw["salt"]), since=float(raw["since"]), reason=str(raw["reason"]))


def salted(body: bytes, salt: str) -> bytes:
    """`body` with `salt` merged into its `cache_salt`. A client's own salt is kept apart (its tenants stay apart from
    each other): the two are joined, or its digest stands in where the join would be too long. A body that is not
    a JSON object, or a salt vLLM would refuse anyway, is left for vLLM to answer as it would."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict):
        return body
    own = payload.get("cache_salt")
    if own is None:
        payload["cache_salt"] = salt
    elif isinstance(own, str) and own and len(own) <= _MAX_SALT and not _FORBIDDEN.intersection(own):
        joined = f"{own}-{salt}"
        if len(joined) > _MAX_SALT:
            joined = f"{hashlib.sha256(own.encode()).hexdigest()[:64]}-{salt}"
        payload["cache_salt"] = joined
    else:
        return body
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def reset_result(status: int, body: bytes) -> bool | None:
    """What an answer of `/reset_prefix_cache` says: True (the cache is empty), False (vLLM could not reset it),
    None (it does not say: an error, or a trainer's server wrapper answering `{"status": "ok"}`)."""
    if status != 200:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    success = payload.get("success") if isinstance(payload, dict) else None
    return success if isinstance(success, bool) else None


def reloaded_adapter(body: bytes) -> str | None:
    """The adapter a `/v1/load_lora_adapter` body loads in place (`load_inplace`), else None. vLLM keys an adapter's
    blocks by its name and path (kv_cache_utils._gen_lora_extra_hash_keys): new files at the same path reuse them."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("load_inplace") is not True:
        return None
    return str(payload.get("lora_name"))
