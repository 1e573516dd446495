"""The admin token rule: who may drive the lifecycle, or read the state and the status page, when `admin_token` is set.

Pure: headers in, the header that carried the token out (it is not forwarded to vLLM), or an error; any front calls
it with the request's headers as a case-insensitive mapping (aiohttp's `CIMultiDictProxy`, multidict's `CIMultiDict`).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pydantic import SecretStr

from .errors import Forbidden, Unauthorized

TOKEN_HEADER = "X-Lifeguard-Token"


def offered_token(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """The token a caller sent and the header that carried it (lower case): `X-Lifeguard-Token` first, else
    `Authorization: Bearer` (scheme in any case); None when neither is there."""
    offered = headers.get(TOKEN_HEADER)
    if offered is not None:
        return "x-lifeguard-token", offered
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return "authorization", auth[7:]
    return None


def token_matches(offered: str, expected: SecretStr) -> bool:
    """Compared in constant time; a token that is not UTF-8 text (aiohttp keeps undecodable header bytes as
    surrogates) is a 401, not a mismatch."""
    try:
        offered_bytes = offered.encode()
    except UnicodeEncodeError:
        raise Unauthorized("the admin token must be UTF-8 text") from None
    return hmac.compare_digest(offered_bytes, expected.get_secret_value().encode())


def check_admin(headers: Mapping[str, str], expected: SecretStr | None) -> frozenset[str]:
    """Raise unless the admin token (when one is set) came with `headers`: 401 when none was sent, 403 when it is
    wrong. Returns the header that carried it, which is not forwarded to vLLM."""
    if expected is None:
        return frozenset()
    found = offered_token(headers)
    if found is None:
        raise Unauthorized("this route needs the admin token (Authorization: Bearer or X-Lifeguard-Token)")
    carrier, offered = found
    if not token_matches(offered, expected):
        raise Forbidden("the admin token is wrong")
    return frozenset({carrier})


# ----- the status page's session: a browser cannot add a header to a page it navigates to, so the page's sign-in form
# (proxy/status_page.py) leaves a cookie instead. It is not the token: an HMAC of the token and an expiry, accepted
# only where a read-only GET needs the token (`/lifeguard/ui`, `/lifeguard/state`), never on a lifecycle or control
# route, so a page on another site that makes the browser send it can drive nothing (SameSite=Strict keeps it from
# being sent at all). A new token ends every session.
SESSION_COOKIE = "lifeguard_ui"
SESSION_S = 12 * 3600


def session_value(expected: SecretStr, expires: int) -> str:
    message = f"vllm-lifeguard status page until {expires}".encode()
    return f"{expires}.{hmac.new(expected.get_secret_value().encode(), message, 'sha256').hexdigest()}"


def session_cookie_name(host: str | None) -> str:
    """Cookies ignore the port: two proxies on one host (two tokens) each keep their own session, named by port."""
    head, sep, port = (host or "").rpartition(":")
    if sep and port.isascii() and port.isdigit() and len(port) <= 5 and (":" not in head or head.endswith("]")):
        return f"{SESSION_COOKIE}_{port}"
    return SESSION_COOKIE


def _session_valid(value: str, expected: SecretStr, now: float) -> bool:
    expires_text = value.partition(".")[0]
    if not (expires_text.isascii() and expires_text.isdigit() and len(expires_text) <= 12):
        return False
    expires = int(expires_text)
    if not now < expires <= now + SESSION_S + 60:
        return False
    try:
        offered = value.encode()
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(offered, session_value(expected, expires).encode())


def _cookies(header: str) -> list[tuple[str, str]]:
    pairs = []
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            pairs.append((name.strip(), value.strip().strip('"')))
    return pairs


def check_reader(headers: Mapping[str, str], expected: SecretStr | None, now: float) -> None:
    """Raise unless whoever sent `headers` may read the state: no token set, the admin token in a header (a wrong
    one is 403), or a live status page session."""
    if expected is None:
        return
    if offered_token(headers) is not None:
        check_admin(headers, expected)
        return
    for name, value in _cookies(headers.get("Cookie", "")):
        if (name == SESSION_COOKIE or name.startswith(SESSION_COOKIE + "_")) and _session_valid(value, expected, now):
            return
    raise Unauthorized(
        "this route needs the admin token (Authorization: Bearer or X-Lifeguard-Token), "
        "or a session of the status page: sign in at /lifeguard/ui"
    )
