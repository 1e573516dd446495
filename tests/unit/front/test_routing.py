"""Where a request goes (proxy/front/routing.py), decided from its method and target alone: no HTTP, no engines
running (the router only needs their names)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import BadTarget, UnknownEngine
from proxy.front.route_table import RouteKind, build_table
from proxy.front.routing import Router, model_of


class Named:
    def __init__(self, name: str) -> None:
        self.name = name


def router(*names: str) -> tuple[Router, dict[str, Any]]:
    engines = {name: Named(name) for name in names}
    return Router(engines, build_table()), engines  # type: ignore[arg-type]


def test_one_engine_takes_every_unprefixed_route_and_its_own_prefix_too() -> None:
    one, engines = router("default")
    plain = one.route(b"POST", b"/v1/completions?x=1")
    assert (plain.kind, plain.engine, plain.target, plain.by_model) == (
        RouteKind.INFERENCE, engines["default"], b"/v1/completions?x=1", False
    )  # fmt: skip
    mounted = one.route(b"POST", b"/engines/default/sleep?level=1")
    assert (mounted.kind, mounted.engine, mounted.path, mounted.query) == (
        RouteKind.LIFECYCLE, engines["default"], "/sleep", "level=1"
    )  # fmt: skip
    assert mounted.target == b"/sleep?level=1"


def test_several_engines_route_inference_by_model_and_anything_else_must_name_its_engine() -> None:
    two, engines = router("policy", "judge")
    inference = two.route(b"POST", b"/v1/chat/completions")
    assert inference.engine is None and inference.by_model
    lifecycle = two.route(b"POST", b"/sleep")
    assert lifecycle.engine is None and not lifecycle.by_model
    error = two.not_chosen(lifecycle)
    assert error.status == 400 and "/engines/policy/sleep" in error.message and "/engines/judge/sleep" in error.message
    assert two.route(b"POST", b"/engines/judge/sleep").engine is engines["judge"]


def test_the_proxys_own_routes_are_about_every_engine_at_the_top_and_about_one_under_its_prefix() -> None:
    two, engines = router("policy", "judge")
    top = two.route(b"GET", b"/lifeguard/state")
    assert top.kind is None and top.engine is None
    one = two.route(b"GET", b"/engines/judge/lifeguard/state")
    assert one.kind is None and one.engine is engines["judge"] and one.path == "/lifeguard/state"
    listing = two.route(b"GET", b"/v1/models")
    assert listing.kind is None and listing.engine is None  # every engine's models, answered by the proxy
    single, only = router("default")
    assert single.route(b"GET", b"/v1/models").engine is only["default"]  # one engine: vLLM's own answer


def test_a_bare_engine_prefix_is_its_root_and_an_encoded_one_is_read_as_its_engine() -> None:
    two, engines = router("policy", "judge")
    bare = two.route(b"GET", b"/engines/judge")
    assert bare.engine is engines["judge"] and bare.path == "/" and bare.target == b"/"
    assert two.route(b"GET", b"/engines/%6Audge/health").engine is engines["judge"]


@pytest.mark.parametrize("target", [b"/engines/nobody/sleep", b"/engines/", b"/engines"])
def test_an_engine_nobody_has_is_404(target: bytes) -> None:
    two, _ = router("policy", "judge")
    with pytest.raises(UnknownEngine) as refused:
        two.route(b"POST", target)
    assert refused.value.status == 404 and "policy, judge" in refused.value.message


def test_a_target_read_two_ways_is_refused_before_any_engine_is_chosen() -> None:
    two, _ = router("policy", "judge")
    with pytest.raises(BadTarget):
        two.route(b"POST", b"/engines/judge/../policy/sleep")


def test_decisions_are_kept_for_the_same_method_and_target() -> None:
    one, _ = router("default")
    assert one.route(b"POST", b"/v1/completions") is one.route(b"POST", b"/v1/completions")


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "judge", "prompt": "x"}', "judge"),
        (b' \r\n {"model":"judge"}', "judge"),  # leading whitespace
        (b'{"prompt": "\\"model\\": \\"policy\\"", "model": "judge"}', "judge"),  # a key inside a string
        (b'{"extra": {"model": "policy"}, "model": "judge"}', "judge"),  # only the top level counts
        (b'{"model": ""}', None),
        (b'{"model": 3}', None),
        (b"[1, 2]", None),
        (b"", None),
        (b"{", None),
        (b"\xff\xfe", None),  # not UTF-8
        (b"[" * 100_000, None),  # nesting deep enough to end the recursion
    ],
)
def test_the_model_is_the_top_level_model_of_a_json_body(body: bytes, model: str | None) -> None:
    assert model_of(body) == model
