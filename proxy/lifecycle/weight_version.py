"""`WeightVersions`: the weight version the proxy vouches for, and how far behind it a request's tokens are.

Sans-IO. A generation advances exactly when the engine's weights change (the prefix cache's rule: a session that wrote
the model, a one-call update, a reload, a LoRA adapter replaced in place, a restarted vLLM), bound to the trainer's
label when it sent one, else to the proxy's own, and to the digest of vLLM's checksums where they were taken. A label
never advances onto partial weights (a failed chunk). Kept in the state file. docs/guides/weight-versions.md,
docs/verification.md (classes 30-32).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import quote

from ..observe.version_metrics import EngineVersionMetrics

log = logging.getLogger("lifeguard.lifecycle")

#: The route that relabels vLLM's weights, and the header on its answer.
RELABEL_PATH = "/update_weight_version"
RELABEL_HEADER = b"X-Lifeguard-Weights-Unchanged"
#: vLLM's read of its label (rl/online/api_router.py: `{"weight_version": ...}`), answered with the vouched one.
WEIGHT_INFO_PATH = "/weight_info"
#: How many past versions are kept to name the spans of a request that lived through several.
_KEPT = 16
# A label goes out in a header as printable ASCII; anything else is percent-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%")


@dataclass(frozen=True)
class WeightVersion:
    """One version of the weights: `generation` counts the changes this proxy (and its predecessors, through the state
    file) saw; `label` is the trainer's, or `lifeguard-<generation>`; `vllm_label` is what vLLM was told (its spans
    carry it); `digest` is one digest of vLLM's checksums of these weights, where they were read."""

    generation: int
    label: str
    vllm_label: str | None
    digest: str | None
    since: float
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> WeightVersion | None:
        if not isinstance(raw, dict):
            return None
        generation, label = raw.get("generation"), raw.get("label")
        if type(generation) is not int or generation < 0 or not isinstance(label, str):
            raise ValueError(f"a weight version without a generation and a label: {raw!r:.200}")
        vllm_label, digest = raw.get("vllm_label"), raw.get("digest")
        return cls(
            generation,
            label,
            vllm_label if isinstance(vllm_label, str) else None,
            digest if isinstance(digest, str) else None,
            float(raw.get("since") or 0.0),
            str(raw.get("why") or ""),
        )

    @property
    def header_value(self) -> bytes:
        return quote(self.label, safe=_HEADER_SAFE).encode("ascii")


def own_label(generation: int) -> str:
    return f"lifeguard-{generation}"


class WeightVersions:
    def __init__(self, metrics: EngineVersionMetrics, on_change: Callable[[], None]) -> None:
        """Generation 0: the weights vLLM holds when this proxy first sees it, labelled as vLLM labels them at start;
        `remember` puts the last proxy's instead. `on_change`: the version changed outside a lifecycle call (a relabel),
        for the state file."""
        self._metrics = metrics
        self._on_change = on_change
        self.current = WeightVersion(0, own_label(0), "default", None, time.time(), "the proxy started")
        self._kept: collections.deque[WeightVersion] = collections.deque([self.current], maxlen=_KEPT)
        # The label the change under way publishes (a finish's `weight_version`), taken by the next advance.
        self._next_label: str | None = None
        # No weight change since the trainer last set the label: a relabel now changes the name only (None: this proxy
        # cannot tell, it has not seen a label set since it started).
        self.unchanged_since_label: bool | None = None
        # The call whose failure left the weights partial; None: they are whole.
        self.partial_after: str | None = None

    def remember(self, version: WeightVersion | None, partial_after: str | None) -> None:
        """What the state file kept of the last proxy's version."""
        if version is not None:
            self.current = version
            self._kept = collections.deque([version], maxlen=_KEPT)
            self._metrics.generation(version.generation)
        self.partial_after = partial_after

    # ----- the weights change
    def label_next(self, label: str | None) -> str:
        """The change under way is to be labelled `label` (the trainer's; None: the proxy's own). Returns the label
        vLLM is to be told."""
        self._next_label = label if label is not None else own_label(self.current.generation + 1)
        return self._next_label

    def advanced(self, why: str, vllm_label: str | None = None) -> WeightVersion:
        """The weights changed (`why`): a new generation, with the label announced for it, else the proxy's own.
        `vllm_label`: the label vLLM holds now when the change set one of its own (a restart: `default`)."""
        generation = self.current.generation + 1
        label, self._next_label = self._next_label, None
        vllm_label = label or vllm_label or self.current.vllm_label
        self.current = WeightVersion(generation, label or own_label(generation), vllm_label, None, time.time(), why)
        self._kept.append(self.current)
        self.unchanged_since_label = False
        self.partial_after = None
        self._metrics.generation(generation)
        log.info("weight version %s (generation %d): %s", self.current.label, generation, why,
                 extra={"event": "weight_version", "label": self.current.label, "generation": generation})  # fmt: skip
        return self.current

    def change_failed(self) -> None:
        """The change under way did not take: its label is not published."""
        self._next_label = None

    def went_partial(self, call: str) -> None:
        """`call` failed mid-way: the weights are neither the last version's nor a new one; no label advances onto
        them, and the next whole change (a session, a one-call update, a reload) ends this."""
        self._next_label = None
        self.partial_after = call
        self._metrics.went_partial()

    def vllm_told(self, label: str) -> None:
        """vLLM's own label is now `label` (the proxy set it after a change that carries none, such as a reload)."""
        self._replace(vllm_label=label)

    def digested(self, digest: str) -> None:
        """vLLM's checksums of the current weights, as one digest."""
        self._replace(digest=digest)

    def relabel_answered(self, body: bytes) -> Callable[[int, bytes], bytes | None]:
        """The reader of an `/update_weight_version` answer: a 200 renames the vouched version (never partial weights),
        and the answer says whether the weights changed since their last label; a relabel without one is passed on
        (trainers relabel after transfers the proxy does not see) and counted."""
        label = label_sent(body, "new_version")

        def answered(status: int, _body: bytes) -> bytes | None:
            if status != 200 or label is None:
                return None
            if self.partial_after is not None:
                log.warning("/update_weight_version %r onto partial weights: the vouched label stays %r", label,
                            self.current.label, extra={"event": "relabel_partial"})  # fmt: skip
                return RELABEL_HEADER + b": unknown"
            unchanged = self.relabeled(label)
            if unchanged:
                self._metrics.relabel_unchanged()
                log.warning("/update_weight_version %r relabels weights that did not change since their last label",
                            label, extra={"event": "relabel_unchanged", "label": label})  # fmt: skip
            self._on_change()
            return RELABEL_HEADER + {True: b": true", False: b": false", None: b": unknown"}[unchanged]

        return answered

    def info_answered(self, status: int, body: bytes) -> bytes | None:
        """vLLM's `/weight_info` answer as the client gets it: `weight_version` is the vouched label (vLLM's, which
        may be `"default"` after a restart or a label sent behind the proxy's back, moves to `vllm_weight_version`),
        with the generation, the digest and whether the weights are partial beside it; None: vLLM's as it came."""
        payload = json_object(body) if status == 200 else None
        if payload is None:
            return None
        current = self.current
        return json.dumps({
            **payload,
            "weight_version": current.label,
            "vllm_weight_version": payload.get("weight_version"),
            "generation": current.generation,
            "digest": current.digest,
            "weights_partial": self.partial_after is not None,
            "partial_after": self.partial_after,
        }).encode()  # fmt: skip

    def relabeled(self, label: str) -> bool | None:
        """The trainer relabelled the weights (`/update_weight_version`); True when nothing changed since the label
        was last set (the proxy saw no weight change: a relabel of the same weights), None: it cannot tell."""
        unchanged = self.unchanged_since_label
        self._replace(label=label, vllm_label=label)
        self.unchanged_since_label = True
        return unchanged

    def labelled(self) -> None:
        """A change was labelled just now: a relabel before the next change changes only the name."""
        self.unchanged_since_label = True

    def _replace(self, **changes: Any) -> None:
        self.current = replace(self.current, **changes)
        self._kept[-1] = self.current

    # ----- what requests read
    def lag(self, generation: int) -> int:
        """How many versions behind the newest one `generation` is."""
        return max(self.current.generation - generation, 0)

    def since(self, generation: int) -> list[WeightVersion]:
        """The versions from `generation` on (the ones a request dispatched then lived through), oldest first."""
        return [version for version in self._kept if version.generation >= generation] or [self.current]

    def snapshot(self) -> dict[str, Any]:
        return {**self.current.as_dict(), "partial_after": self.partial_after}


def json_object(body: bytes) -> dict[str, Any] | None:
    """A request body as the JSON object it should be; None for anything else (vLLM answers that itself)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def label_sent(body: bytes, key: str) -> str | None:
    """The label a `/finish_weight_update` (`weight_version`) or `/update_weight_version` (`new_version`) body
    carries; None when it carries none, or one vLLM would refuse (it answers that itself)."""
    payload = json_object(body)
    value = payload.get(key) if payload is not None else None
    return value if isinstance(value, str) else None


def with_label(body: bytes, label: str) -> bytes | None:
    """A `/finish_weight_update` body that publishes `label` (an empty body becomes one); None for a body that is not
    a JSON object, left for vLLM to answer."""
    payload = json_object(body) if body.strip() else {}
    return None if payload is None else json.dumps({**payload, "weight_version": label}).encode()


def vouched_spans(spans: list[Any], lived: list[WeightVersion]) -> list[Any]:
    """vLLM's `weight_versions` spans (`WeightVersionSpan`: version, start, end) with each label replaced by the
    vouched one of the version that produced it: the version vLLM knew by that label among those the request lived
    through (newest first), else, as vLLM saw one label per change, the one at the same place in order."""
    out = []
    for index, span in enumerate(spans):
        if not isinstance(span, dict):
            out.append(span)
            continue
        said = span.get("version")
        match = next((v for v in reversed(lived) if v.vllm_label == said), None)
        if match is None:
            match = lived[min(index, len(lived) - 1)]
        out.append({**span, "version": match.label})
    return out
