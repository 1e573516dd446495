"""Parameters are validated before anything is sent; the call is rebuilt in the form vLLM understands."""

import pytest

from proxy.errors import BadParameter
from proxy.lifecycle.parsed_calls import parse_call


@pytest.mark.parametrize(
    ("op", "query", "param"),
    [
        ("sleep", [("level", "3")], "query.level"),
        ("sleep", [("level", "-1")], "query.level"),
        ("sleep", [("level", "one")], "query.level"),
        ("sleep", [("mode", "drain")], "query.mode"),
        ("pause", [("mode", "bogus")], "query.mode"),
        ("pause", [("clear_cache", "maybe")], "query.clear_cache"),
        ("sleep", [("reset_connector", "maybe")], "query.reset_connector"),
        ("wake_up", [("tags", "weights,bogus")], "query.tags"),
        ("wake_up", [("tags", "")], "query.tags"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(op: str, query: list[tuple[str, str]], param: str) -> None:
    with pytest.raises(BadParameter) as err:
        parse_call(op, query, b"")
    assert err.value.param == param
    assert err.value.status == 400
    assert err.value.error_type == "Bad Request"  # vLLM's own answer to a query that fails validation


def test_json_nested_past_the_parser_is_a_400_not_a_crash() -> None:
    """100,000 nested `[` made json.loads raise RecursionError, which escaped as 503 proxy_error."""
    with pytest.raises(BadParameter) as err:
        parse_call("collective_rpc", [], b"[" * 100_000)
    assert err.value.status == 400 and err.value.param == "body"


def test_comma_joined_and_repeated_tags_are_both_accepted_and_sent_repeated() -> None:
    joined = parse_call("wake_up", [("tags", "weights,kv_cache")], b"")
    repeated = parse_call("wake_up", [("tags", "weights"), ("tags", "kv_cache")], b"")
    assert joined.query == repeated.query == (("tags", "weights"), ("tags", "kv_cache"))
    assert joined.key == repeated.key


def test_sleep_defaults_match_vllm() -> None:
    call = parse_call("sleep", [], b"")
    assert (call.level, call.mode) == (1, "abort")
    assert call.query == (("level", "1"), ("mode", "abort"))


def test_vllm_034s_reset_connector_is_kept_not_dropped() -> None:
    """vLLM 0.34 added it to /sleep (default true); a trainer's `false` must reach vLLM, older releases ignore it."""
    call = parse_call("sleep", [("level", "1"), ("reset_connector", "False")], b"")
    assert call.query == (("level", "1"), ("mode", "abort"), ("reset_connector", "false"))
    assert call.key != parse_call("sleep", [("level", "1")], b"").key  # not joined with a call that resets


def test_the_deprecated_wait_flag_forces_wait_mode() -> None:
    call = parse_call("pause", [("wait_for_inflight_requests", "true")], b"")
    assert call.mode == "wait"


@pytest.mark.parametrize("body", [b"", b"not json", b"[]", b'{"args": []}', b'{"method": 3}'])
def test_collective_rpc_needs_a_json_body_with_a_method(body: bytes) -> None:
    with pytest.raises(BadParameter):
        parse_call("collective_rpc", [], body)


def test_collective_rpc_method_is_read() -> None:
    assert parse_call("collective_rpc", [], b'{"method": "reload_weights"}').rpc_method == "reload_weights"
