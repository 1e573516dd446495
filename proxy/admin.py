"""The admin token (`admin_token`): who may call the routes that change or steer an engine.

Lifecycle and control calls, and routes no table knows, need it when it is set; inference and read-only
routes never do. It comes as `Authorization: Bearer <token>` or `X-Lifeguard-Token: <token>`, is compared in
constant time, and the header that carried it is never forwarded to vLLM.
"""

from __future__ import annotations

import hmac

from .errors import Forbidden, Unauthorized

_NOTHING: frozenset[bytes] = frozenset()


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
