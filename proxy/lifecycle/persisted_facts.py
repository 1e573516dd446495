"""`PersistedFacts`: what the record holds true that vLLM cannot be asked for, as one value: what the state file
(state_file.py) keeps for a restarted proxy and the record (record.py) adopts. Sans-IO."""

from __future__ import annotations

from dataclasses import dataclass

from .prefix_cache import Partition
from .rules import Staleness
from .weight_version import WeightVersion


@dataclass(frozen=True)
class PersistedFacts:
    # Why the weights vLLM holds were not the intended ones; None: they were valid.
    weights_stale: Staleness | None = None
    # The pause to re-apply on the next wake (a /pause recorded while asleep).
    user_pause: str | None = None
    # What the proxy held to be asleep, and at which level: only a verified wake clears them.
    asleep_tags: tuple[str, ...] = ()
    sleep_level: int | None = None
    # The flags read asleep but nothing was freed (a /sleep from PAUSED that did nothing reads the same): a
    # repeat of that sleep is sent to vLLM, not answered as a no-op.
    sleep_unconfirmed: bool = False
    # The asleep tags were put to sleep by a worker RPC behind vLLM's executor (skyrl_sleep_for_weight_sync):
    # vLLM's flags read "paused", and only that RPC's wake brings them back.
    asleep_outside_vllm: bool = False
    # vLLM's prefix cache may hold blocks computed by older weights; admitted inference carries this salt.
    prefix_partition: Partition | None = None
    # The weight update session vLLM holds open (what it writes: model, drafter, lora_adapter), and the state its
    # finish returns to: vLLM has no flag for a session, and an /update_weights inside one is not a whole update.
    weight_update_session: str | None = None
    session_returns_to: str | None = None
    # One digest of vLLM's weight checksums taken before a level-1 sleep (weight_checksums: always): what its wake must
    # bring back, also when no proxy saw the wake (a proxy killed while it ran, or restarted while vLLM slept).
    weights_before_sleep: str | None = None
    # The weight version the proxy vouches for (weight_version.py): its generation and label outlive the proxy, and
    # the call whose failure left the weights partial.
    weight_version: WeightVersion | None = None
    weights_partial_after: str | None = None
    # A sleep or KV-cache release kept the KV connector's offload tier (vLLM 0.34's `reset_connector=false`): vLLM
    # shows no such thing, and the tier outlives the proxy (offload_tier.py).
    offload_tier_kept: bool = False

    def __str__(self) -> str:
        """The facts in words, for the log line of a restarted proxy."""
        said = [f"weights {self.weights_stale}" if self.weights_stale is not None else "weights current"]
        if self.asleep_tags:
            level = f" at level {self.sleep_level}" if self.sleep_level is not None else ""
            unconfirmed = ", unconfirmed" if self.sleep_unconfirmed else ""
            outside = ", by a worker RPC" if self.asleep_outside_vllm else ""
            said.append(f"asleep ({', '.join(self.asleep_tags)}){level}{unconfirmed}{outside}")
        if self.user_pause is not None:
            said.append(f"a pause ({self.user_pause}) to re-apply on the wake")
        if self.weight_update_session is not None:
            said.append(f"a weight update session open on the {self.weight_update_session}")
        if self.prefix_partition is not None:
            said.append("inference salted apart from the old prefix cache")
        if self.weights_before_sleep is not None:
            said.append("the weights' checksums before the sleep")
        if self.weight_version is not None:
            said.append(f"weight version {self.weight_version.label!r} (generation {self.weight_version.generation})")
        if self.weights_partial_after is not None:
            said.append(f"weights partial after a failed {self.weights_partial_after}")
        if self.offload_tier_kept:
            said.append("the KV connector's offload tier kept through a sleep")
        return "; ".join(said)
