"""What vLLM's answer to a forwarded inference request says about the engine: a refusal not to pass on.

Pure: status, headers and body in, a `Refusal` or nothing out. On a refusal the data plane holds the request again
and tells the coordinator (`engine_refused`), which reads vLLM's flags. Two refusals, told apart by status, type
and body shape, never by message text: `ENGINE_PAUSED` (vLLM >= 0.33's pause) and `ELASTIC_EP` (the elastic-EP
middleware's gate). The shapes, from vLLM's source: docs/design.md.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from .elastic_ep import gate_message

# vLLM's paused-refusal event is ~170 bytes; a first event longer than this is not it, and the stream flows on.
MAX_FIRST_EVENT_BYTES = 4096

# The error types vLLM gives a RetryableRequestError: create_error_response's, and the chat stream's own.
_PAUSED_TYPES = frozenset({"ServiceUnavailableError"})
_PAUSED_STREAM_TYPES = frozenset({"ServiceUnavailableError", "InternalServerError"})
# vLLM's ErrorInfo (serve/engine/protocol.py), no more: a proxy's own error (reason, src) is not vLLM's refusal.
_VLLM_ERROR_KEYS = frozenset({"message", "type", "param", "code"})


class RefusalKind(enum.StrEnum):
    ENGINE_PAUSED = "engine_paused"
    ELASTIC_EP = "elastic_ep"


@dataclass(frozen=True)
class Refusal:
    kind: RefusalKind
    # vLLM's own words, for the logs and the held request's eventual error; never used to decide anything.
    message: str


class Pending(enum.Enum):
    """A stream's first event is not complete yet: keep its bytes back and ask again with more."""

    MORE = "more"


#: The status of every complete answer that is a refusal: any other is relayed without a look at its body.
REFUSAL_STATUS = 503


def response_refusal(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> Refusal | None:
    """The refusal a complete (non-streaming) answer is, if it is one: a 503 with vLLM's paused envelope, or the
    elastic-EP middleware's plain body."""
    if status != REFUSAL_STATUS or not _is_json(headers):
        return None
    if (gated := gate_message(status, body)) is not None:
        return Refusal(RefusalKind.ELASTIC_EP, gated)
    return _paused_refusal(body, _PAUSED_TYPES)


def stream_refusal(status: int, headers: Iterable[tuple[bytes, bytes]], received: bytes) -> Refusal | Pending | None:
    """Whether a streamed answer opens with vLLM's paused refusal, from the body bytes received so far (de-chunked).

    None: it does not (not a 200 event stream, or its first event is a token, a role chunk, anything else): relay it,
    bytes kept back included. `Pending.MORE`: the first event is not complete; keep the bytes back and ask again when
    more arrive (at most MAX_FIRST_EVENT_BYTES are needed). A `Refusal`: nothing of the stream may reach the client.
    """
    if status != 200 or not _is_event_stream(headers):
        return None
    event = _first_event(received)
    if event is None:
        return Pending.MORE if len(received) < MAX_FIRST_EVENT_BYTES else None
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
    return _paused_refusal(data, _PAUSED_STREAM_TYPES)


def _paused_refusal(raw: bytes, paused_types: Collection[object]) -> Refusal | None:
    """`raw` is vLLM's error envelope and nothing else (`{"error": {...}}`, only vLLM's keys), saying the engine is
    paused: code 503 and one of `paused_types`."""
    payload = _json(raw)
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return None
    error = payload["error"]
    if not isinstance(error, dict) or not set(error) <= _VLLM_ERROR_KEYS:
        return None
    if error.get("code") == 503 and error.get("type") in paused_types:
        return Refusal(RefusalKind.ENGINE_PAUSED, str(error.get("message", "")))
    return None


def _first_event(received: bytes) -> bytes | None:
    """The first SSE event that carries data, once complete; comment events (`: keep-alive`) are skipped."""
    text = received.replace(b"\r\n", b"\n")
    start = 0
    while True:
        end = text.find(b"\n\n", start)
        if end < 0:
            return None
        event = text[start:end]
        if any(line.startswith(b"data:") for line in event.splitlines()):
            return event
        start = end + 2


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key.lower() == name:
            return value.lower()
    return b""


def _is_json(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return _header(headers, b"content-type").split(b";")[0].strip() == b"application/json"


def _is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return _header(headers, b"content-type").split(b";")[0].strip() == b"text/event-stream"


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
