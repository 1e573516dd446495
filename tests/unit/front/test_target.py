"""The request target is read once: what is classified is exactly what vLLM routes."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import BadTarget
from proxy.front.route_table import VLLM_ROUTES, RouteKind, build_table
from proxy.front.target import below_mount, canonical_target

TABLE = build_table()


@pytest.mark.parametrize(
    "raw",
    [
        "/./sleep",
        "/v1/../sleep",
        "/%2e/sleep",
        "/%2E%2E/sleep",
        "/v1/%2e%2e/sleep",
        "/v1/.%2e/sleep",
        "//sleep",
        "/v1//completions",
        "/sleep/.",
        "/sleep/..",
        "/a%2fsleep",
        "/a%2Fb",
        "/a%5cb",
        "/a\\sleep",
        "/sl%00eep",
        "/sl%zzeep",
        "/sl%e",
        "/sleep#frag",
        "/%ff",
        "/sl eep",
        "/sl\u00e9ep",
        "sleep",
        "*",
        "example.com:443",
    ],
)
def test_a_target_two_parsers_could_read_differently_is_refused(raw: str) -> None:
    with pytest.raises(BadTarget) as err:
        canonical_target(raw)
    assert err.value.status == 400
    assert "/" in err.value.message or "'" in err.value.message


@pytest.mark.parametrize(
    ("raw", "path", "forwarded"),
    [
        ("/v1/completions", "/v1/completions", "/v1/completions"),
        ("/sleep?level=2&mode=keep", "/sleep", "/sleep?level=2&mode=keep"),
        ("/sl%65ep", "/sleep", "/sl%65ep"),  # uvicorn decodes before starlette routes: so do we
        ("/v1/models/", "/v1/models/", "/v1/models/"),
        ("/wake_up?tags=%2e%2e", "/wake_up", "/wake_up?tags=%2e%2e"),  # the query is not a path
        ("/v1/models/my.model", "/v1/models/my.model", "/v1/models/my.model"),
        ("http://vllm:8000/sleep?level=1", "/sleep", "/sleep?level=1"),
        ("HTTPS://vllm/v1/completions", "/v1/completions", "/v1/completions"),
        ("http://vllm:8000", "/", "/"),
    ],
)
def test_a_canonical_target_is_classified_decoded_and_forwarded_as_sent(raw: str, path: str, forwarded: str) -> None:
    target = canonical_target(raw)
    assert (target.path, target.raw) == (path, forwarded)


_ROUTES = sorted({(methods[0], path) for methods, path, _ in VLLM_ROUTES if "{" not in path and methods[0] != "*"})


@st.composite
def _variants(draw: st.DrawFn) -> tuple[str, str, str]:
    """A known route written another way: some characters %-encoded, dot segments or slashes added."""
    method, path = draw(st.sampled_from(_ROUTES))
    out = []
    for char in path:
        if char != "/" and draw(st.booleans()):
            out.append("%" + format(ord(char), "02" + draw(st.sampled_from("xX"))))
        else:
            out.append(char)
        if char == "/" and draw(st.integers(0, 6)) == 0:
            out.append(draw(st.sampled_from(["./", "../v1/", "%2e/", "%2E%2e/", "/", ".%2e/"])))
    return method, path, "".join(out)


@given(_variants())
def test_no_spelling_of_a_route_is_classified_as_another_kind(variant: tuple[str, str, str]) -> None:
    """Whatever the spelling, the target is refused or classified as the route it is, and the bytes forwarded
    decode (as uvicorn decodes them) to exactly the classified path."""
    method, path, raw = variant
    try:
        target = canonical_target(raw)
    except BadTarget:
        return
    assert unquote(target.raw) == target.path
    assert TABLE.classify(method, target.path) is TABLE.classify(method, path)


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=40))
def test_any_accepted_target_forwards_the_path_it_classified(tail: str) -> None:
    try:
        target = canonical_target("/" + tail)
    except BadTarget:
        return
    raw_path = target.raw.partition("?")[0]
    assert unquote(raw_path) == target.path
    segments = target.path.split("/")
    assert "." not in segments and ".." not in segments
    assert "" not in segments[1:-1]


def test_every_lifecycle_spelling_that_decodes_to_it_is_lifecycle() -> None:
    for raw in ("/sleep", "/sl%65ep", "/%73leep", "/sleep/", "http://h/sleep"):
        assert TABLE.classify("POST", canonical_target(raw).path) is RouteKind.LIFECYCLE


def test_a_mounted_engine_sees_the_target_below_its_mount_with_the_raw_bytes_unchanged() -> None:
    target = below_mount(canonical_target("/engines/a/v1/compl%65tions?x=%2F"), "/engines/a")
    assert (target.path, target.raw, target.query) == ("/v1/completions", "/v1/compl%65tions?x=%2F", "x=%2F")
    assert below_mount(canonical_target("/engines/a"), "/engines/a").raw == "/"
    assert below_mount(canonical_target("/engines/%61/sleep"), "/engines/a").raw == "/sleep"  # %61 is "a"


def test_a_target_not_below_the_mount_is_refused() -> None:
    with pytest.raises(BadTarget):
        below_mount(canonical_target("/engines/b/sleep"), "/engines/a")
    with pytest.raises(BadTarget):
        below_mount(canonical_target("/engines/ab/sleep"), "/engines/a")
