"""The status page as served (proxy/front/status_page.py): self-contained, locked down, and who gets it with a
token set."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from proxy.errors import Forbidden, Unauthorized
from proxy.front.admin import SESSION_S, admin_carrier, check_reader, session_value
from proxy.front.status_page import PAGE, PAGE_HEADERS, Answer, page_answer, sign_in_answer

TOKEN = b"s3cret-admin-token-4f9a"
NOW = 1_800_000_000.0
PATH = "/lifeguard/ui"


def headers(**values: str) -> list[tuple[bytes, bytes]]:
    """As llhttp gives them: bytes pairs, names in the client's case."""
    return [(name.replace("_", "-").encode(), value.encode()) for name, value in values.items()]


def answer_headers(answer: Answer) -> dict[str, str]:
    return {name.decode(): value.decode() for name, value in answer.headers}


def signed_in_cookie(path: str = PATH, host: str = "127.0.0.1:8080") -> tuple[str, str]:
    answer = sign_in_answer(headers(Host=host), b"token=" + TOKEN, TOKEN, path, NOW)
    assert answer.status == 303, answer.body
    return answer_headers(answer)["Set-Cookie"], answer_headers(answer)["Location"]


# ----- the page itself
def test_the_page_loads_nothing_from_anywhere_else() -> None:
    """The sidecar often runs without internet: no CDN, no font, no image, no script from another origin."""
    text = PAGE.decode()
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), "an absolute URL"
    assert not re.search(r"""(src|href|action)\s*=\s*["'](?!data:)""", text), "a resource reference"
    assert "@import" not in text and "url(" not in text and "@font-face" not in text
    assert re.findall(r"fetch\(([^,)]+)", text) == ["STATE_URL"]
    assert 'const STATE_URL = "state";' in text  # relative: /lifeguard/state, or /engines/<name>/lifeguard/state


def test_the_policy_lets_only_the_page_s_own_script_and_style_run() -> None:
    sent = {name.decode(): value.decode() for name, value in PAGE_HEADERS}
    policy = dict(part.strip().split(" ", 1) for part in sent["Content-Security-Policy"].split(";"))
    text = PAGE.decode()
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
        assert len(bodies) == 1
        digest = base64.b64encode(hashlib.sha256(bodies[0].encode()).digest()).decode()
        assert policy[directive] == f"'sha256-{digest}'"
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    assert "unsafe" not in sent["Content-Security-Policy"]
    assert sent["Cache-Control"] == "no-store"


def test_the_page_reads_both_shapes_of_the_state() -> None:
    """Several engines under "engines" (and, after the one-front rewrite, one engine too), or the flat snapshot."""
    text = PAGE.decode()
    assert "function enginesOf(state)" in text
    assert 'if (engines && typeof engines === "object" && !Array.isArray(engines)) return engines;' in text
    assert 'return { [state.name || "default"]: state };' in text


# ----- who gets it
def test_without_a_token_the_page_is_open() -> None:
    answer = page_answer(headers(), None, PATH, NOW)
    assert (answer.status, answer.body) == (200, PAGE)
    assert answer.content_type == b"text/html; charset=utf-8"


def test_with_a_token_set_a_browser_without_it_gets_the_sign_in_form_with_401() -> None:
    answer = page_answer(headers(), TOKEN, PATH, NOW)
    assert answer.status == 401
    assert answer_headers(answer)["X-Lifeguard-Reason"] == "unauthorized"
    body = answer.body.decode()
    assert '<form method="post" action="ui">' in body and 'type="password"' in body
    assert "<script" not in body and PAGE not in answer.body
    assert "script-src 'none'" in answer_headers(answer)["Content-Security-Policy"]


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        ({"x_lifeguard_token": TOKEN.decode()}, 200),
        ({"Authorization": f"bearer {TOKEN.decode()}"}, 200),
        ({"X_Lifeguard_Token": "wrong"}, 403),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
    ],
)
def test_a_script_sends_the_token_in_a_header_as_on_every_guarded_route(sent: dict[str, str], status: int) -> None:
    assert page_answer(headers(**sent), TOKEN, PATH, NOW).status == status


def test_signing_in_sets_a_read_only_session_cookie_that_is_not_the_token() -> None:
    cookie, location = signed_in_cookie()
    assert location == "ui"
    name_value, *attributes = [part.strip() for part in cookie.split(";")]
    name, value = name_value.split("=", 1)
    assert name == "lifeguard_ui_8080"  # two proxies on one host keep two sessions
    assert set(attributes) == {"Path=/lifeguard", "HttpOnly", "SameSite=Strict"}
    assert TOKEN.decode() not in cookie
    assert value == session_value(TOKEN, int(NOW) + SESSION_S)
    # it opens the page and the state ...
    assert page_answer(headers(Cookie=f"other=1; {name}={value}"), TOKEN, PATH, NOW + 60).status == 200
    check_reader(headers(Cookie=f"{name}={value}"), TOKEN, NOW + 60)
    # ... and nothing else: a lifecycle call with the cookie alone is 401
    with pytest.raises(Unauthorized):
        admin_carrier(headers(Cookie=f"{name}={value}"), TOKEN)


def test_a_session_ends_after_twelve_hours_or_with_a_new_token() -> None:
    cookie, _ = signed_in_cookie()
    jar = cookie.split(";", 1)[0]
    assert page_answer(headers(Cookie=jar), TOKEN, PATH, NOW + SESSION_S - 1).status == 200
    assert page_answer(headers(Cookie=jar), TOKEN, PATH, NOW + SESSION_S + 1).status == 401
    assert page_answer(headers(Cookie=jar), b"a-new-token", PATH, NOW + 60).status == 401


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        f"{int(NOW) + 3600}.{'0' * 64}",  # a guessed MAC
        f"{int(NOW) + 10 * SESSION_S}." + session_value(TOKEN, int(NOW) + 10 * SESSION_S).split(".")[1],  # too long
        "١٢٣٤.abc",  # Unicode digits
        "9" * 40 + ".x",
    ],
)
def test_a_forged_or_broken_session_cookie_is_401(value: str) -> None:
    with pytest.raises(Unauthorized):
        check_reader(headers(Cookie=f"lifeguard_ui={value}"), TOKEN, NOW)


def test_a_wrong_token_in_the_form_is_403_and_sets_nothing() -> None:
    answer = sign_in_answer(headers(), b"token=wrong", TOKEN, PATH, NOW)
    assert answer.status == 403 and "Set-Cookie" not in answer_headers(answer)
    assert b"the admin token is wrong" in answer.body


@pytest.mark.parametrize(
    "form",
    [b"", b"token=", b"nothing=here", b"token=a&token=b", b"token=%ff%fe", b"token=\xff", b"&".join([b"x=1"] * 20)],
)
def test_a_form_without_exactly_one_readable_token_is_400(form: bytes) -> None:
    answer = sign_in_answer(headers(), form, TOKEN, PATH, NOW)
    assert answer.status == 400 and "Set-Cookie" not in answer_headers(answer)
    assert answer_headers(answer)["X-Lifeguard-Reason"] == "bad_parameter"


def test_an_engine_s_own_page_keeps_its_session_under_its_own_path() -> None:
    cookie, location = signed_in_cookie("/engines/policy/lifeguard/ui", host="[::1]:9000")
    assert "Path=/engines/policy/lifeguard" in cookie and cookie.startswith("lifeguard_ui_9000=")
    assert location == "ui"


def test_signing_in_with_no_token_set_just_goes_to_the_page() -> None:
    answer = sign_in_answer(headers(), b"", None, PATH, NOW)
    assert (answer.status, answer_headers(answer)["Location"]) == (303, "ui")
    assert "Set-Cookie" not in answer_headers(answer)


def test_a_wrong_header_token_is_refused_even_with_a_good_cookie() -> None:
    """The header is what a script meant: a wrong one is an error to show, not something a cookie papers over."""
    jar = signed_in_cookie()[0].split(";", 1)[0]
    with pytest.raises(Forbidden):
        check_reader(headers(Cookie=jar, X_Lifeguard_Token="wrong"), TOKEN, NOW + 1)
