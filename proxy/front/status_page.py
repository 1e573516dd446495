"""`/lifeguard/ui`: one self-contained, read-only status page that draws `/lifeguard/state` every second.

Pure functions for the page's two requests (headers and body in, a `wire.Answer` out); own_answers.py routes them.
With `admin_token` set the page answers 401 with a sign-in form whose POST leaves a session cookie (admin.py).
Every answer carries a Content-Security-Policy that allows only the page's own hashed script and style.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import re
from importlib import resources
from urllib.parse import parse_qs

from ..errors import BadParameter, Forbidden, LifeguardError
from .admin import SESSION_S, check_reader, header, session_cookie_name, session_value
from .wire import Answer

PAGE_PATH = "/lifeguard/ui"
PAGE = resources.files(__package__).joinpath("status_page.html").read_bytes()


def _inline_hashes(page: str, tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


def _headers(page: bytes) -> tuple[tuple[bytes, bytes], ...]:
    text = page.decode()
    scripts = _inline_hashes(text, "script") or "'none'"
    policy = (
        f"default-src 'none'; script-src {scripts}; "
        f"style-src {_inline_hashes(text, 'style')}; connect-src 'self'; img-src data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    )
    return (
        (b"Content-Security-Policy", policy.encode()),
        (b"Cache-Control", b"no-store"),
        (b"X-Content-Type-Options", b"nosniff"),
        (b"X-Frame-Options", b"DENY"),
        (b"Referrer-Policy", b"no-referrer"),
    )


_SIGN_IN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="referrer" content="no-referrer">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>vllm-lifeguard: sign in</title>
<link rel="icon" href="data:,">
<style>
body { font: 14px/1.4 system-ui, sans-serif; background: #f6f7f9; color: #1d2330; margin: 0; }
form { max-width: 420px; margin: 12vh auto; background: #fff; border: 1px solid #dde1e8; border-radius: 8px;
       padding: 20px; }
h1 { font-size: 18px; margin: 0 0 12px; } p { color: #6a7282; } .why { color: #d64545; }
input { width: 100%; padding: 6px 8px; font: inherit; margin: 6px 0 12px; } button { padding: 6px 14px; font: inherit; }
</style></head>
<body><form method="post" action="{action}">
<h1>vllm-lifeguard status</h1>
<p class="why">{why}</p>
<label for="token">Admin token (<code>LIFEGUARD_ADMIN_TOKEN</code>)</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Show the status page</button>
<p>The page then keeps a read-only session cookie for 12 hours; it cannot drive the engine.</p>
</form></body></html>
"""


HTML = b"text/html; charset=utf-8"


PAGE_HEADERS = _headers(PAGE)
_NO_STORE = ((b"Cache-Control", b"no-store"),)


def _page_name(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] or "ui"


def _sign_in(error: LifeguardError, path: str) -> Answer:
    body = _SIGN_IN.replace("{action}", html.escape(_page_name(path))).replace("{why}", html.escape(error.message))
    encoded = body.encode()
    return Answer(error.status, encoded, HTML, (*_headers(encoded), (b"X-Lifeguard-Reason", error.reason.encode())))


def page_answer(headers: list[tuple[bytes, bytes]], token: bytes | None, path: str, now: float) -> Answer:
    """`GET /lifeguard/ui` (`path`: as the client sent it, mount included): the page, or the sign-in form with 401
    (no token, no session) or 403 (a wrong token)."""
    try:
        check_reader(headers, token, now)
    except LifeguardError as exc:
        return _sign_in(exc, path)
    return Answer(200, PAGE, HTML, PAGE_HEADERS)


def sign_in_answer(
    headers: list[tuple[bytes, bytes]], form: bytes, token: bytes | None, path: str, now: float
) -> Answer:
    """`POST /lifeguard/ui` from the sign-in form: 303 back to the page with the session cookie, or the form again
    with 400 (no token in it, or not UTF-8) or 403 (a wrong token)."""
    page = _page_name(path).encode()
    if token is None:
        return Answer(303, b"", None, ((b"Location", page), *_NO_STORE))
    try:
        fields = parse_qs(form.decode("ascii"), max_num_fields=8, errors="strict")
    except ValueError:  # not ASCII, a bad %-escape in UTF-8, too many fields
        fields = {}
    offered = fields.get("token", [])
    if len(offered) != 1 or not offered[0]:
        return _sign_in(BadParameter("the form must carry exactly one token", param="token"), path)
    if not hmac.compare_digest(offered[0].encode(), token):
        return _sign_in(Forbidden("the admin token is wrong"), path)
    folder = path.rstrip("/").rpartition("/")[0]
    if not re.fullmatch(r"(/[A-Za-z0-9._~-]+)+", folder):
        folder = "/lifeguard"
    cookie = (
        f"{session_cookie_name(header(headers, b'host'))}={session_value(token, int(now) + SESSION_S)}; "
        f"Path={folder}; HttpOnly; SameSite=Strict"
    )
    return Answer(303, b"", None, ((b"Location", page), (b"Set-Cookie", cookie.encode()), *_NO_STORE))
