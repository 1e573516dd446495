"""The HTTP/1.1 bytes the proxy writes itself, sans I/O: the one place each framing rule is written.

What is never forwarded (hop-by-hop headers, the admin credential; nothing added, no `X-Forwarded-For`); the error
body in vLLM's OpenAI shape plus `reason` and `"src": "lifeguard"`, with `X-Lifeguard-Reason` and, on 503,
`Retry-After`; a stream that already started ends with the error as an SSE event.
"""

from __future__ import annotations

import http
import json
import math
from dataclasses import dataclass, field

from ..errors import LifeguardError, UpstreamRejected

HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",  # the front answers `Expect: 100-continue` itself
        # The proxy's own admin credential: it authorises the call here and is never vLLM's business.
        b"x-lifeguard-token",
    }
)
#: Every `X-Lifeguard-*` header the proxy sends or reads, and what it says (docs/reference/headers.md is made from
#: this; tests/tooling/test_docs_reference.py checks it names each one spelled out in proxy/).
LIFEGUARD_HEADERS: dict[str, str] = {
    "X-Lifeguard-Token": "Request, to the proxy: the admin token (`admin_token`), instead of `Authorization: Bearer`. "
    "Never forwarded to vLLM.",
    "X-Lifeguard-Reason": "Response: on every error the proxy answers itself, its reason (docs/reference/errors.md); "
    "also on a vLLM refusal of a lifecycle call relayed as it was (`upstream_rejected`).",
    "X-Lifeguard-Verified": "Response of a lifecycle call vLLM answered 200: each verification check and its result, "
    "`name=result` comma-separated (`health=pass,flags=pass,memory=unavailable`).",
    "X-Lifeguard-Noop": "Response of a lifecycle call: `true` when the proxy answered it without calling vLLM, the "
    "engine being where the call asks already (a repeated /sleep, a /wake_up while awake).",
    "X-Lifeguard-Deferred": "Response of a /pause sent while the engine sleeps: `pause applied on wake`; the pause is "
    "applied by the proxy right after the next wake.",
    "X-Lifeguard-Drained": "Response of a sleep that waited for requests in flight (`drain_before_sleep_s`): "
    "`complete` when every one finished, else `timeout; N aborted`.",
    "X-Lifeguard-Pause-Kept": "Response of a /wake_up of an engine a client had paused before its sleep: the pause "
    "mode (`keep`, `wait` ...), re-applied after vLLM's wake lifted it.",
    "X-Lifeguard-Weights-Stale": "Response of inference forwarded while the engine's weights are known stale and "
    "inference is not held for it (after a restart, `hold_while_weights_stale: false`): `true`.",
    "X-Lifeguard-Prefix-Cache": "Response of a client's `/reset_prefix_cache`: `partitioned` while vLLM's prefix cache "
    "may still hold blocks of older weights (admitted inference then carries the proxy's `cache_salt`), else `clean`.",
    "X-Lifeguard-Weight-Version": "Response of every inference request forwarded: the label of the weight version the "
    "proxy vouches for when it dispatched the request (the trainer's, else `lifeguard-<generation>`; "
    "percent-encoded outside printable ASCII). docs/guides/weight-versions.md.",
    "X-Lifeguard-Weights-Unchanged": "Response of `/update_weight_version`: `true` when the proxy saw no weight change "
    "since the label was last set (a relabel of the same weights), `false` when it saw one, `unknown` when it cannot "
    "tell (no label set since it started).",
}
END_CHUNKS = b"0\r\n\r\n"
JSON = b"application/json"
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response the proxy makes itself (its own routes, a lifecycle call's outcome)."""

    status: int
    body: bytes
    content_type: bytes | None = JSON
    headers: tuple[tuple[bytes, bytes], ...] = field(default_factory=tuple)


def json_answer(payload: object, status: int = 200) -> Answer:
    return Answer(status, json.dumps(payload).encode())


def error_answer(error: LifeguardError) -> Answer:
    """The one rendering of an error the proxy answers."""
    if isinstance(error, UpstreamRejected):
        content_type = (error.content_type or "application/json").encode("latin-1")
        return Answer(error.status, error.body, content_type, ((b"X-Lifeguard-Reason", error.reason.encode()),))
    headers = [(b"X-Lifeguard-Reason", error.reason.encode())]
    if error.status == 503 or error.retry_after is not None:
        headers.append((b"Retry-After", b"%d" % max(1, math.ceil(error.retry_after or 1))))
    body = {"error": {**error_fields(error), "param": error.param}}
    return Answer(error.status, json.dumps(body).encode(), JSON + b"; charset=utf-8", tuple(headers))


def error_fields(error: LifeguardError) -> dict[str, object]:
    return {
        "message": error.message,
        "type": error.error_type,
        "param": None,
        "code": error.status,
        "reason": error.reason,
        "src": "lifeguard",
        **error.details,
    }


def sse_error_event(error: LifeguardError) -> bytes:
    """The last event of a stream the proxy had to end (vLLM's own in-stream error shape)."""
    return b"data: " + json.dumps({"error": error_fields(error)}).encode() + b"\n\n"


def answer_bytes(answer: Answer, *, close: bool, http10: bool = False, head_only: bool = False) -> bytes:
    """`answer` as a whole HTTP/1.1 response; `close` adds `Connection: close`, an HTTP/1.0 client that stays
    gets `Connection: keep-alive`; `head_only` (a HEAD request) keeps the length and drops the body."""
    lines = [b"HTTP/1.1 %d %b" % (answer.status, _PHRASES.get(answer.status, b"Error"))]
    if answer.content_type is not None:
        lines.append(b"Content-Type: " + answer.content_type)
    lines += [name + b": " + value for name, value in answer.headers]
    lines.append(b"Content-Length: %d" % len(answer.body))
    if close:
        lines.append(b"Connection: close")
    elif http10:
        lines.append(b"Connection: keep-alive")
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head_only else answer.body)


def error_bytes(error: LifeguardError, *, close: bool = False) -> bytes:
    """The whole response for `error`; the error's own `close_connection` closes too."""
    return answer_bytes(error_answer(error), close=close or error.close_connection)


def relative_location(location: bytes, origins: tuple[bytes, ...]) -> bytes:
    """`location` made relative when it points at one of `origins` (vLLM's own address: starlette's
    trailing-slash redirect names it, and the client must stay with the proxy)."""
    for origin in origins:
        if location.startswith(origin) and location[len(origin) : len(origin) + 1] in (b"", b"/", b"?"):
            return location[len(origin) :] or b"/"
    return location
