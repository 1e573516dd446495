"""The admin token (`admin_token`): who may call the routes that change or steer an engine, and read its state.

Lifecycle and control calls, and routes no table knows, need it when it is set; inference and read-only routes never
do. It comes as `Authorization: Bearer <token>` or `X-Lifeguard-Token`, is compared in constant time and never
forwarded to vLLM. The status page's session cookie is an HMAC of the token and an expiry, accepted only by its
read-only GETs. Pure: llhttp's `(name, value)` header pairs in, an answer or an error out. docs/security.md.
"""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from ..errors import Forbidden, Unauthorized

_NOTHING: frozenset[bytes] = frozenset()
SESSION_COOKIE = "lifeguard_ui"
SESSION_S = 12 * 3600


def token_bytes(secret: SecretStr | None) -> bytes | None:
    """The `admin_token` setting as the bytes the checks below compare."""
    return secret.get_secret_value().encode() if secret is not None else None


def admin_carrier(headers: list[tuple[bytes, bytes]], token: bytes | None) -> frozenset[bytes]:
    """The (lower-case) name of the header that carried the admin token, to be dropped on the way to vLLM;
    raises Unauthorized (no token) or Forbidden (a wrong one). Nothing to check when no token is set."""
    if token is None:
        return _NOTHING
    offered: bytes | None = None
    carrier = b"x-lifeguard-token"
    bearer: bytes | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"x-lifeguard-token":
            offered = value
        elif lowered == b"authorization" and value[:7].lower() == b"bearer ":
            bearer = value[7:]
    if offered is None and bearer is not None:
        offered, carrier = bearer, b"authorization"
    if offered is None:
        raise Unauthorized("this route needs the admin token (Authorization: Bearer or X-Lifeguard-Token)")
    try:
        offered.decode()
    except UnicodeDecodeError:
        raise Unauthorized("the admin token must be UTF-8 text") from None
    if not hmac.compare_digest(offered, token):
        raise Forbidden("the admin token is wrong")
    return frozenset({carrier})


# ----- the status page's session
def session_value(token: bytes, expires: int) -> str:
    message = f"vllm-lifeguard status page until {expires}".encode()
    return f"{expires}.{hmac.new(token, message, 'sha256').hexdigest()}"


def session_cookie_name(host: bytes | None) -> str:
    """Cookies ignore the port: two proxies on one host (two tokens) each keep their own session, named by port."""
    head, sep, port = (host or b"").decode("latin-1").rpartition(":")
    if sep and port.isascii() and port.isdigit() and len(port) <= 5 and (":" not in head or head.endswith("]")):
        return f"{SESSION_COOKIE}_{port}"
    return SESSION_COOKIE


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower case)."""
    return next((value for key, value in headers if key.lower() == name), None)


def _carries_token(name: bytes, value: bytes) -> bool:
    return name == b"x-lifeguard-token" or (name == b"authorization" and value[:7].lower() == b"bearer ")


def _session_valid(value: str, token: bytes, now: float) -> bool:
    expires_text = value.partition(".")[0]
    if not (expires_text.isascii() and expires_text.isdigit() and len(expires_text) <= 12):
        return False
    expires = int(expires_text)
    if not now < expires <= now + SESSION_S + 60:
        return False
    return hmac.compare_digest(value.encode("latin-1"), session_value(token, expires).encode())


def _cookies(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    pairs = []
    for key, value in headers:
        if key.lower() != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            name, sep, text = part.strip().partition("=")
            if sep:
                pairs.append((name.strip(), text.strip().strip('"')))
    return pairs


def check_reader(headers: list[tuple[bytes, bytes]], token: bytes | None, now: float) -> None:
    """Raise unless whoever sent `headers` may read the state: no token set, the admin token in a header (a wrong
    one is 403), or a live status page session."""
    if token is None:
        return
    if any(_carries_token(name.lower(), value) for name, value in headers):
        admin_carrier(headers, token)  # what a script meant: a wrong one is 403, whatever cookie came along
        return
    for name, value in _cookies(headers):
        if (name == SESSION_COOKIE or name.startswith(SESSION_COOKIE + "_")) and _session_valid(value, token, now):
            return
    raise Unauthorized(
        "this route needs the admin token (Authorization: Bearer or X-Lifeguard-Token), "
        "or a session of the status page: sign in at /lifeguard/ui"
    )
