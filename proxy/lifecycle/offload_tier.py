"""A KV connector's offload tier (vLLM 0.34's `--kv-transfer-config` CPU/SSD tier) in the prefix-cache guarantee.

The tier keeps KV blocks under the same chain of hashes as the GPU prefix cache, and those hashes do not cover the
weights (vLLM PR #57810): after a weight change a kept tier serves KV the old weights computed, the prefix-cache lie one
tier down. `/reset_prefix_cache` empties it only with `reset_external=true`, which vLLM treats as a success where no
connector is configured, and older releases ignore. So every reset that ends the prefix cache's partition empties both
tiers: the proxy's own, and a client's sent while the partition lasts, unless the client says `reset_external=false`
itself: its choice is kept, and so is the partition, until a reset empties the tier too. A sleep or KV-cache release
told to keep the tier (`reset_connector=false`) is recorded (`offload_tier_kept` in /lifeguard/state, kept in the state
file for a restarted proxy) until the proxy's next reset empties it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from .parsed_calls import LifecycleCall

#: The query that makes `/reset_prefix_cache` empty the connector's tier too.
RESET_EXTERNAL = ("reset_external", "true")
# What vLLM's FastAPI reads as a false `bool` query (pydantic's lax booleans).
_FALSE = ("false", "0", "no", "off", "f", "n")


def keeps_tier(call: LifecycleCall) -> bool:
    """A sleep or KV-cache release that tells vLLM 0.34 to keep the connector's tier."""
    return call.op in ("sleep", "release_kv_cache_memory") and any(
        name == "reset_connector" and value.lower() in _FALSE for name, value in call.query
    )


def emptying_both_tiers(target: bytes) -> bytes:
    """A client's `/reset_prefix_cache` target sent while old-weight blocks may be cached: made to empty the offload
    tier too, unless it names `reset_external` itself."""
    if b"reset_external=" in target:
        return target
    return target + (b"&" if b"?" in target else b"?") + b"reset_external=true"


def tier_kept_by(target: bytes) -> bool:
    """A client's `/reset_prefix_cache` target that tells vLLM to leave the offload tier as it is."""
    query = urlsplit(target.decode("latin-1")).query
    return any(name == "reset_external" and value.lower() in _FALSE for name, value in parse_qsl(query))
