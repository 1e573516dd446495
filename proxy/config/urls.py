"""vLLM's base URL in the settings: what they accept (what aiohttp can connect to), and how it may be shown (never
its password: URLs reach errors, logs and /lifeguard/state)."""

from __future__ import annotations

from yarl import URL


def http_url(value: str, *, or_else: str) -> str:
    """`value` as vLLM's base URL (no trailing slash), or the ValueError that says what it lacks: the proxy connects
    with aiohttp, so what yarl cannot read (no host, a port that is no number) is refused here, not at start."""
    shown = url_shown(value)
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"must start with http:// or https://{or_else} (got {shown!r})")
    try:
        host = URL(value).raw_host
    except ValueError as exc:
        why = str(exc).removeprefix("Invalid URL: ")
        raise ValueError(f"is not a URL the proxy can connect to: {why[:1].lower()}{why[1:]} (got {shown!r})") from None
    if not host:
        raise ValueError(f"has no host: give http://HOST:PORT (got {shown!r})")
    return value.rstrip("/")


def url_shown(url: str) -> str:
    """`url` as it may appear in an error, a log line or /lifeguard/state: a password in it as `***`, whether or not
    the rest is a URL (`user:pw@host:8000` without a scheme too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}{slash}{path}"
