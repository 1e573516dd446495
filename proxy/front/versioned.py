"""`VersionStamp`: what one forwarded inference answer says of the weights that produced it.

Every answer gets `X-Lifeguard-Weight-Version` (the vouched version at dispatch). Where the client asked for spans
(`return_weight_versions: true`) and vLLM (0.33+) gave them, their labels are rewritten to the vouched ones of the
versions the request lived through (proxy/lifecycle/weight_version.py); at its end the request's lag and tokens are
counted. Only a request that asked is parsed; any other is passed through as it came.
"""

from __future__ import annotations

import functools
import json
import logging
import re

from ..lifecycle.weight_version import WeightVersion, WeightVersions, json_object, vouched_spans
from ..observe.version_metrics import EngineVersionMetrics

log = logging.getLogger("lifeguard.forward")

_ASKED = b'"return_weight_versions"'
_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"
_STREAM_USAGE = b'"usage":{'
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_LENGTH = re.compile(rb"\r\ncontent-length: *\d+", re.IGNORECASE)
HEADER = b"X-Lifeguard-Weight-Version: "


@functools.lru_cache(maxsize=64)
def _header_line(version: WeightVersion) -> bytes:
    """Made once per version, not once per answer: quoting a label costs more than the rest of the stamp."""
    return HEADER + version.header_value


def with_length(head: bytes, body: bytes) -> bytes:
    """A whole answer's head with the Content-Length of the body that replaces vLLM's."""
    return _LENGTH.sub(b"\r\nContent-Length: %d" % len(body), head, count=1)


def _tokens_of(choice: dict[str, object]) -> int:
    """The tokens one choice of an answer (or of a stream's event) carries: its `token_ids` (`return_token_ids`), else
    one for a piece of text (vLLM streams one token a step, and holds back none but a partial character's)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choice.get("delta")
    text = choice.get("text") if "text" in choice else (delta.get("content") if isinstance(delta, dict) else None)
    return 1 if text else 0


def asked_for_spans(body: bytes) -> bool:
    """Whether an inference body asks for `weight_versions` spans (read only when the key is there at all)."""
    payload = json_object(body) if _ASKED in body else None
    return payload is not None and payload.get("return_weight_versions") is True


class VersionStamp:
    __slots__ = ("_versions", "dispatched", "asked", "_tail", "_events", "_tokens", "_spans", "_counted", "_usage")

    def __init__(self, versions: WeightVersions, body: bytes) -> None:
        self._versions = versions
        self.dispatched: WeightVersion = versions.current
        self.asked = asked_for_spans(body)
        self._tail = b""  # an SSE event not whole yet (only for a stream that asked)
        self._events = 0
        self._tokens: int | None = None
        # A stream that asked, on a vLLM that gives no spans: each choice's spans as its tokens were relayed.
        self._spans: dict[int, list[tuple[str, int, int]]] | None = None
        # Each choice's tokens as vLLM's continuous usage counted them; what usage the client itself asked for.
        self._counted: dict[int, int] = {}
        self._usage: tuple[bool, bool] | None = None

    @property
    def header_line(self) -> bytes:
        return _header_line(self.dispatched)

    # ----- the request's bytes
    def request_body(self, body: bytes) -> bytes:
        """A stream that asked is sent with vLLM's continuous usage (`stream_options`): each chunk then counts its
        choice's tokens so far, exact where a lagging reader gets several tokens in one chunk. What the client did not
        ask for of it is taken out of the events again (`_rewritten`)."""
        payload = json_object(body)
        if payload is None or payload.get("stream") is not True:
            return body
        options = payload.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self._usage = (options.get("include_usage") is True, options.get("continuous_usage_stats") is True)
        payload["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()

    # ----- the answer's bytes
    def whole(self, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        """A whole (non-stream) answer: its usage read; for a request that asked, its spans' labels vouched, or (vLLM
        0.32, no spans) spans of the proxy's own (the head's Content-Length follows the body)."""
        self._read_usage(body)
        if not self.asked:
            return head, body
        relabelled = self._rewritten(body, whole=True)
        if relabelled is None:
            return head, body
        return with_length(head, relabelled), relabelled

    def stream(self, data: bytes) -> bytes:
        """A piece of an SSE stream: counted; for a request that asked, whole events go out with their spans vouched
        (or made, on vLLM 0.32), the rest waits for its end."""
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
        events = (self._event(event) for event in data[: cut + 2].split(_EVENT_END))
        return _EVENT_END.join(event for event in events if event is not None)

    def stream_end(self) -> bytes:
        """What is left of a stream that asked, at its end."""
        tail, self._tail = self._tail, b""
        return tail

    def _event(self, event: bytes) -> bytes | None:
        """One event of a stream that asked, rewritten; None: the usage chunk only the proxy asked for."""
        if not event.startswith(_DATA) or event.startswith(_DONE):
            return event
        rewritten = self._rewritten(event[len(_DATA) :], whole=False)
        if rewritten == b"":
            return None
        return event if rewritten is None else _DATA + rewritten

    def _rewritten(self, raw: bytes, *, whole: bool) -> bytes | None:
        """An answer (or a stream's event) with every choice's spans vouched: vLLM's relabelled where it gave them;
        else, as vLLM 0.32 gives none, the proxy's own at a choice's end (a stream: each token under the version that
        was the newest when it was relayed, which a keep-mode update splits exactly: nothing is produced between the
        pause and the resume; a whole answer: one span, unless the weights changed while it ran). None: unchanged."""
        try:
            payload = json.loads(raw)
        except ValueError:
            return None
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            return None
        changed = False
        usage = payload.get("usage") if not whole else None
        if self._usage is not None and "usage" in payload:
            if not choices and not self._usage[0]:
                return b""  # the usage chunk the proxy asked for
            if choices and not self._usage[1]:
                del payload["usage"]
                changed = True
        counted = usage.get("completion_tokens") if isinstance(usage, dict) and len(choices) == 1 else None
        lived = self._versions.since(self.dispatched.generation)
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            spans = choice.get("weight_versions")
            if isinstance(spans, list):
                choice["weight_versions"] = vouched_spans(spans, lived)
                changed = True
                continue
            index = choice.get("index", 0)
            if whole:
                ids = choice.get("token_ids")
                tokens = len(ids) if isinstance(ids, list) else self._tokens if len(choices) == 1 else None
                if "weight_versions" not in choice and len(lived) == 1 and tokens is not None:
                    choice["weight_versions"] = [{"version": self.dispatched.label, "start": 0, "end": tokens}]
                    changed = True
                continue
            if isinstance(counted, int):  # continuous usage: this choice's tokens so far
                tokens, self._counted[index] = counted - self._counted.get(index, 0), counted
            else:
                tokens = _tokens_of(choice)
            made = self._relayed(index, tokens)
            if choice.get("finish_reason") is not None and "weight_versions" not in choice:
                choice["weight_versions"] = [{"version": label, "start": a, "end": b} for label, a, b in made]
                changed = True
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() if changed else None

    def _relayed(self, index: int, tokens: int) -> list[tuple[str, int, int]]:
        """`tokens` of choice `index` relayed now, under the newest version: its spans so far."""
        if self._spans is None:
            self._spans = {}
        spans = self._spans.setdefault(index, [])
        if tokens:
            label, end = self._versions.current.label, spans[-1][2] if spans else 0
            if spans and spans[-1][0] == label:
                spans[-1] = (label, spans[-1][1], end + tokens)
            else:
                spans.append((label, end, end + tokens))
        return spans

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
