"""The route table: every vLLM route on purpose, trainers' framework routes pass, unknown ones by setting."""

from __future__ import annotations

import pytest

from proxy.front.route_table import FRAMEWORK_ROUTES, LIFECYCLE_PATHS, VLLM_ROUTES, RouteKind, build_table

TABLE = build_table()


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/release_kv_cache_memory", RouteKind.LIFECYCLE),
        ("POST", "/v1/load_lora_adapter", RouteKind.SERIALIZED),
        ("POST", "/v1/unload_lora_adapter", RouteKind.SERIALIZED),
        ("DELETE", "/adapters/my-adapter", RouteKind.SERIALIZED),
        ("POST", "/scale_elastic_ep", RouteKind.SERIALIZED),
        ("POST", "/weight_checker", RouteKind.SERIALIZED),
        ("POST", "/fault_tolerance/apply", RouteKind.SERIALIZED),
        ("POST", "/start_profile", RouteKind.AT_ONCE),
        ("POST", "/abort_requests", RouteKind.AT_ONCE),
        ("POST", "/v1/responses/resp_123/cancel", RouteKind.NEVER_GATED),
        ("GET", "/v1/responses/resp_123", RouteKind.NEVER_GATED),
        ("GET", "/tokenizer_info", RouteKind.NEVER_GATED),
        ("POST", "/is_scaling_elastic_ep", RouteKind.NEVER_GATED),
        ("POST", "/v1/chat/completions/render", RouteKind.NEVER_GATED),
        ("POST", "/v1/messages", RouteKind.INFERENCE),
        ("POST", "/inference/v1/generate", RouteKind.INFERENCE),
        ("POST", "/skyrl/v1/load_lora_adapter", RouteKind.SERIALIZED),
        ("POST", "/skyrl/v1/generate", RouteKind.INFERENCE),
        ("POST", "/areal_pause_generation", RouteKind.AT_ONCE),
        ("POST", "/areal_update_weights", RouteKind.AT_ONCE),
        ("POST", "/some/new/route", RouteKind.UNKNOWN),
        ("GET", "/some/new/route", RouteKind.NEVER_GATED),
        ("GET", "/sleep", RouteKind.NEVER_GATED),
        ("POST", "/sleep/", RouteKind.LIFECYCLE),
        ("PUT", "/metrics", RouteKind.NEVER_GATED),
    ],
)
def test_the_table_classifies(method: str, path: str, kind: RouteKind) -> None:
    assert TABLE.classify(method, path) is kind


def test_unknown_routes_hold_treats_them_as_inference() -> None:
    table = build_table(unknown_routes="hold")
    assert table.classify("POST", "/some/new/route") is RouteKind.INFERENCE
    assert table.classify("POST", "/areal_continue_generation") is RouteKind.AT_ONCE


def test_declared_routes_come_first_but_never_take_a_lifecycle_path() -> None:
    table = build_table(
        [
            ("inference", ["/my/generate", "/tokenize"]),
            ("at_once", ["/my_admin/*", "/sleep"]),
            ("never_gated", ["/x/{id}"]),
        ]
    )
    assert table.classify("POST", "/my/generate") is RouteKind.INFERENCE
    assert table.classify("POST", "/tokenize") is RouteKind.INFERENCE
    assert table.classify("POST", "/my_admin/a/b") is RouteKind.AT_ONCE
    assert table.classify("POST", "/x/42") is RouteKind.NEVER_GATED
    assert table.classify("POST", "/x/42/y") is RouteKind.UNKNOWN
    assert table.classify("POST", "/sleep") is RouteKind.LIFECYCLE


def test_each_route_is_listed_once() -> None:
    seen: set[tuple[str, str]] = set()
    for methods, path, _ in (*VLLM_ROUTES, *FRAMEWORK_ROUTES):
        for method in methods:
            assert (method, path) not in seen, (method, path)
            seen.add((method, path))


def test_every_lifecycle_path_is_a_post_lifecycle_route() -> None:
    for path in LIFECYCLE_PATHS:
        assert TABLE.lookup("POST", path) is not None
        assert TABLE.classify("POST", path) is RouteKind.LIFECYCLE
