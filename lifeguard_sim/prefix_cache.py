"""vLLM's prefix cache, as far as the weights are concerned (vllm/v1/core/kv_cache_utils.py, block_pool.py).

A prompt's full blocks are hashed in a chain from the first, the first with the request's `cache_salt` (and a LoRA
adapter's name in every block); a request reuses the longest run of cached blocks, computed by whatever weights
were loaded then. A reset clears every hash, and fails (`success: false`) while a running request holds blocks
(`BlockPool.reset_prefix_cache`). What a reused block was computed under is kept, so a request served from blocks
of older weights answers as those weights would, and the engine records it.

With a KV connector that offloads (vLLM's `--kv-transfer-config`, e.g. the OffloadingConnector's CPU tier, LMCache's
CPU/SSD tier) the cache has a `lower` tier: every block computed is also stored there, and a block the GPU cache misses
is loaded from it when the tier has its hash. The tier keys blocks by the same chain of hashes, which do not cover the
weights (vLLM PR #57810): it is emptied only by a reset that includes the connector (`reset_external=true`, a sleep or
a `release_kv_cache_memory` with `reset_connector` true, a cache-clearing pause), so after a weight change a kept tier
serves KV computed by the old weights.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# vLLM's validate_cache_salt (entrypoints/generate/base/protocol.py).
_MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\x00")
SALT_MESSAGE = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
_CAPACITY = 4096  # blocks kept, least recently used dropped first


def salt_problem(salt: object) -> str | None:
    """vLLM's refusal of a `cache_salt`, or None for an acceptable one (or none)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > _MAX_SALT or _FORBIDDEN.intersection(salt):
        return SALT_MESSAGE
    return None


class PrefixCache:
    def __init__(self, block_tokens: int, lower: PrefixCache | None = None) -> None:
        self.block_tokens = block_tokens
        self.lower = lower
        # block hash -> the weights (Engine.text_seed) its KV was computed with
        self._blocks: OrderedDict[bytes, str] = OrderedDict()
        # Where the last serve() met its older weights: "gpu", "offload" (the lower tier), or None.
        self.older_from: str | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def serve(self, tokens: list[int], *, salt: str | None, lora: str | None, weights: str) -> tuple[int, str | None]:
        """Prefill `tokens` under `weights`, reusing the longest run of cached blocks (from this tier, else the lower
        one): (the prompt tokens read from cached blocks, the older weights those blocks were computed with, if any
        was). The prompt's own full blocks are cached from then on, in both tiers."""
        hit_tokens, older, self.older_from = 0, None, None
        parent = b""
        reusing = True
        for start in range(0, len(tokens) - self.block_tokens + 1, self.block_tokens):
            block = tokens[start : start + self.block_tokens]
            extra = f"lora={lora}|salt={salt if start == 0 and salt else ''}"
            parent = hashlib.sha256(parent + extra.encode() + b"".join(t.to_bytes(4, "little") for t in block)).digest()
            where, computed = "gpu", self._blocks.get(parent)
            if computed is None and self.lower is not None:
                where, computed = "offload", self.lower._blocks.get(parent)
            if reusing and computed is not None:
                hit_tokens += self.block_tokens
                self._store(parent, computed)  # a block loaded from the lower tier is in the GPU cache from now on
                if computed != weights and older is None:
                    older, self.older_from = computed, where
                continue
            reusing = False
            self._store(parent, weights)
            if self.lower is not None:
                self.lower._store(parent, weights)
        return hit_tokens, older

    def _store(self, key: bytes, weights: str) -> None:
        self._blocks[key] = weights
        self._blocks.move_to_end(key)
        if len(self._blocks) > _CAPACITY:
            self._blocks.popitem(last=False)

    def reset(self) -> None:
        self._blocks.clear()
