"""`VersionStamp`: what one forwarded inference answer says of the weights that produced it.

Every answer gets `X-Lifeguard-Weight-Version` (the vouched version at dispatch). Where the client asked for spans
(`return_weight_versions: true`) and vLLM (0.33+) gave them, their labels are rewritten to the vouched ones of the
versions the request lived through (proxy/lifecycle/weight_version.py); at its end the request's lag and tokens are
counted. Only a request that asked is parsed; any other is passed through as it came.
"""

from __future__ import annotations

import json
import logging
import re

from ..lifecycle.weight_version import WeightVersion, WeightVersions, vouched_spans
from ..observe.version_metrics import EngineVersionMetrics

log = logging.getLogger("lifeguard.forward")

_ASKED = b'"return_weight_versions"'
_SPANS = b'"weight_versions":'
_EVENT_END = b"\n\n"
_DATA = b"data: "
_STREAM_USAGE = b'"usage":{'
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_LENGTH = re.compile(rb"\r\ncontent-length: *\d+", re.IGNORECASE)
HEADER = b"X-Lifeguard-Weight-Version: "


def asked_for_spans(body: bytes) -> bool:
    """Whether an inference body asks for `weight_versions` spans (read only when the key is there at all)."""
    if _ASKED not in body:
        return False
    try:
        payload = json.loads(body)
    except ValueError:
        return False
    return isinstance(payload, dict) and payload.get("return_weight_versions") is True


class VersionStamp:
    __slots__ = ("_versions", "dispatched", "asked", "_tail", "_events", "_tokens")

    def __init__(self, versions: WeightVersions, body: bytes) -> None:
        self._versions = versions
        self.dispatched: WeightVersion = versions.current
        self.asked = asked_for_spans(body)
        self._tail = b""  # an SSE event not whole yet (only for a stream that asked)
        self._events = 0
        self._tokens: int | None = None

    @property
    def header_line(self) -> bytes:
        return HEADER + self.dispatched.header_value

    # ----- the answer's bytes
    def whole(self, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        """A whole (non-stream) answer: its usage read; for a request that asked, its spans' labels vouched (the head's
        Content-Length follows the body)."""
        self._read_usage(body)
        if not self.asked or _SPANS not in body:
            return head, body
        relabelled = self._relabel_json(body)
        if relabelled is None:
            return head, body
        return _LENGTH.sub(b"\r\nContent-Length: %d" % len(relabelled), head, count=1), relabelled

    def stream(self, data: bytes) -> bytes:
        """A piece of an SSE stream: counted; for a request that asked, whole events go out with their spans vouched,
        the rest waits for its end."""
        self._events += data.count(_DATA)
        if _STREAM_USAGE in data:  # stream_options.include_usage: its tokens, exactly
            self._read_usage(data)
        if not self.asked:
            return data
        data = self._tail + data
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            self._tail = data
            return b""
        self._tail = data[cut + 2 :]
        events = data[: cut + 2]
        if _SPANS not in events:
            return events
        return _EVENT_END.join(self._event(event) for event in events.split(_EVENT_END))

    def stream_end(self) -> bytes:
        """What is left of a stream that asked, at its end."""
        tail, self._tail = self._tail, b""
        return tail

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA) or _SPANS not in event:
            return event
        self._read_usage(event)
        relabelled = self._relabel_json(event[len(_DATA) :])
        return event if relabelled is None else _DATA + relabelled

    def _relabel_json(self, raw: bytes) -> bytes | None:
        try:
            payload = json.loads(raw)
        except ValueError:
            return None
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            return None
        lived = self._versions.since(self.dispatched.generation)
        for choice in choices:
            spans = choice.get("weight_versions") if isinstance(choice, dict) else None
            if isinstance(spans, list):
                choice["weight_versions"] = vouched_spans(spans, lived)
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()

    def _read_usage(self, data: bytes) -> None:
        found = _USAGE.search(data)
        if found is not None:
            self._tokens = int(found.group(1))

    # ----- its end
    def ended(self, metrics: EngineVersionMetrics, engine: str) -> None:
        """The request ended: its lag (versions between the one it was dispatched on and the newest) and tokens."""
        lag = self._versions.lag(self.dispatched.generation)
        tokens = self._tokens if self._tokens is not None else max(self._events - 1, 0)  # less the stream's [DONE]
        metrics.request_ended(lag, tokens)
        if lag:
            newest = self._versions.current
            log.info("an inference request ended %d weight version(s) behind: dispatched on %s, newest %s", lag,
                     self.dispatched.label, newest.label,
                     extra={"event": "request_version_lag", "engine": engine, "version_lag": lag, "tokens": tokens,
                            "dispatched_version": self.dispatched.label, "newest_version": newest.label})  # fmt: skip
