"""lifecycle/offload_tier.py: which calls keep the connector's tier, and a client's reset made to empty it."""

from __future__ import annotations

from proxy.lifecycle.offload_tier import emptying_both_tiers, keeps_tier, tier_kept_by
from proxy.lifecycle.parsed_calls import parse_call


def test_a_sleep_or_release_told_reset_connector_false_keeps_the_tier_and_nothing_else_does() -> None:
    assert keeps_tier(parse_call("sleep", [("level", "1"), ("reset_connector", "False")], b""))
    assert keeps_tier(parse_call("release_kv_cache_memory", [("reset_connector", "0")], b""))
    assert not keeps_tier(parse_call("sleep", [("level", "1")], b""))
    assert not keeps_tier(parse_call("wake_up", [("reset_connector", "false")], b""))


def test_a_clients_reset_is_made_to_empty_the_tier_unless_it_names_reset_external_itself() -> None:
    assert emptying_both_tiers(b"/reset_prefix_cache") == b"/reset_prefix_cache?reset_external=true"
    assert emptying_both_tiers(b"/reset_prefix_cache?reset_running_requests=true") == (
        b"/reset_prefix_cache?reset_running_requests=true&reset_external=true"
    )
    assert (
        emptying_both_tiers(b"/reset_prefix_cache?reset_external=false") == b"/reset_prefix_cache?reset_external=false"
    )


def test_a_clients_reset_keeps_the_tier_only_where_it_says_reset_external_false() -> None:
    assert tier_kept_by(b"/reset_prefix_cache?reset_external=false")
    assert tier_kept_by(b"/reset_prefix_cache?reset_running_requests=true&reset_external=0")
    assert not tier_kept_by(b"/reset_prefix_cache?reset_external=true")
    assert not tier_kept_by(b"/reset_prefix_cache")
