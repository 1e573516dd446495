"""The request target, decided once: the path that is classified is the path vLLM routes.

vLLM (starlette) routes on the percent-decoded path without resolving dot segments; yarl would resolve them. So a
target whose meaning depends on who normalises it is refused with 400 (dot or empty segments, an encoded slash or
backslash, a raw backslash, a NUL, a broken escape, a fragment); every other target is classified on its decoded
path and forwarded with its bytes unchanged. Absolute-form targets are taken as their origin-form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from ..errors import BadTarget

# Visible ASCII only (RFC 3986: anything else is %-encoded), and no backslash, which some servers read as '/'.
_BAD_RAW = re.compile(r"[^\x21-\x7e]|[\\#]")
_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_AMBIGUOUS_ESCAPES = ("%2f", "%5c", "%00")
_ABSOLUTE = re.compile(r"^[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")


@dataclass(frozen=True, slots=True)
class Target:
    """`path`: decoded, what the route table and vLLM's router see. `raw`: path and query as sent."""

    path: str
    raw: str
    query: str


def canonical_target(raw_target: str) -> Target:
    """The one reading of a request target; raises BadTarget (400) for a target read two ways."""
    raw = raw_target
    if raw[:1] != "/":
        absolute = _ABSOLUTE.match(raw)
        if absolute is None:
            raise BadTarget(f"the request target must be a path starting with '/', got {_shown(raw_target)}")
        raw = raw[absolute.end() :] or "/"
        if raw[:1] != "/":
            raw = "/" + raw
    raw_path, _, query = raw.partition("?")
    if _BAD_RAW.search(raw_path) or _ESCAPE.search(raw_path):
        raise BadTarget(f"the request path {_shown(raw_path)} has a character or %-escape it may not have")
    path = raw_path
    if "%" in raw_path:
        lowered = raw_path.lower()
        if any(escape in lowered for escape in _AMBIGUOUS_ESCAPES):
            raise BadTarget(f"the request path {_shown(raw_path)} encodes a '/', '\\' or NUL")
        try:
            path = unquote(raw_path, errors="strict")
        except UnicodeDecodeError:
            raise BadTarget(f"the request path {_shown(raw_path)} does not decode as UTF-8") from None
    if "//" in path or "." in path:
        for segment in path.split("/")[1:-1]:
            if segment in ("", ".", ".."):
                raise BadTarget(f"the request path {_shown(raw_path)} has an empty, '.' or '..' segment")
        if path.endswith(("/.", "/..")):
            raise BadTarget(f"the request path {_shown(raw_path)} has a '.' or '..' segment")
    return Target(path, raw, query)


def below_mount(target: Target, mount: str) -> Target:
    """`target` as the engine mounted at `mount` (`/engines/<name>`) sees it: the mount's segments taken off
    the decoded path and off the raw bytes alike (an encoded '/' is refused, so both have the same segments);
    the rest of the raw target is unchanged. The whole target was read (and any ambiguity refused) before."""
    depth = mount.count("/")
    path_parts = target.path.split("/", depth + 1)
    if "/".join(path_parts[: depth + 1]) != mount:
        raise BadTarget(f"the request path {_shown(target.path)} is not below {mount}")
    raw_path, mark, query = target.raw.partition("?")
    raw_rest = raw_path.split("/", depth + 1)[depth + 1 :]
    path_rest = path_parts[depth + 1 :]
    return Target("/" + "".join(path_rest), "/" + "".join(raw_rest) + mark + query, query)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:200] + "...")
