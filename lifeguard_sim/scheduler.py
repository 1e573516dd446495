"""The scheduler's side of the engine: tracked requests, the pause state, and waiting for change.

Requests are plain records; the coroutine serving a request drives its own generation and parks on
``wait_for_change`` whenever the scheduler may not admit or step it. Every state change calls
``notify`` so parked requests re-check at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from lifeguard_sim.errors import EngineGone

# Parked requests also re-check this often, to notice a client that went away without a cancellation.
_RECHECK_SECONDS = 0.05


class PauseState(Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # nothing new is admitted; running requests keep stepping
    PAUSED_ALL = "paused_all"  # token budget 0: running requests freeze in place


@dataclass(eq=False)
class SimRequest:
    """One generation request inside the engine."""

    request_id: str
    external_id: str | None
    prompt_tokens: int
    max_tokens: int
    client_gone: Callable[[], bool] = lambda: False
    running: bool = False
    produced: int = 0
    finish_reason: str | None = None
    finished: bool = False
    ran_on_invalid_weights: bool = False
    ran_on_altered_weights: bool = False
    set_out: float = 0.0  # when it set out for the engine (time.time())
    # vLLM's RequestState.weight_version_starts (v1/engine/output_processor.py): (label, first output token) each
    # time the engine's weight-version label differs from the last token's.
    version_starts: list[tuple[str, int]] = field(default_factory=list)
    # The same for what the weights truly were (Engine.model_seed, or the older weights of a stale prefix): the
    # simulator's own record of which weights produced each token, for the journal.
    weights_starts: list[tuple[str, int]] = field(default_factory=list)


def track(starts: list[tuple[str, int]], label: str, at: int) -> None:
    """vLLM's RequestState.track_weight_version: a new span when the label differs from the last one."""
    if not starts or starts[-1][0] != label:
        starts.append((label, at))


def spans(starts: list[tuple[str, int]], produced: int, key: str = "version") -> list[dict[str, object]]:
    """vLLM's `_weight_version_spans` as JSON (`WeightVersionSpan` in vllm/outputs.py): output tokens [start, end)
    under each label. Every simulated token has a label, so vLLM's None (tokens and no label) never arises; a request
    that produced nothing has []."""
    ends = [start for _, start in starts[1:]] + [produced] if starts else []
    return [{key: label, "start": start, "end": end} for (label, start), end in zip(starts, ends, strict=True)]


@dataclass
class Stats:
    """Monotonic numbers /metrics exports."""

    generation_tokens: int = 0
    prompt_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    durations: dict[str, list[float]] = field(default_factory=lambda: {"sleep": [], "wake": []})


class Scheduler:
    def __init__(self) -> None:
        self.pause_state = PauseState.UNPAUSED
        self.requests: dict[str, SimRequest] = {}
        self.stats = Stats()
        self.client_disconnects = 0
        self._changed = asyncio.Event()
        self.gone = False
        # EngineCoreProc._idle_state_callbacks: run once, the first time a pause is complete.
        self.on_drained: list[Callable[[], None]] = []

    # --- waking parked coroutines
    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_drained and self.pause_state is not PauseState.UNPAUSED and self.drained and not self.gone:
            callbacks, self.on_drained = self.on_drained, []
            for callback in callbacks:
                callback()

    async def wait_for_change(self) -> None:
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), _RECHECK_SECONDS)
        except TimeoutError:
            pass

    async def until(self, ready: Callable[[], bool], req: SimRequest | None = None) -> None:
        """Park until ``ready()``; returns early if ``req`` finished or its client left."""
        while True:
            if self.gone:
                raise EngineGone
            if req is not None and not req.finished and req.client_gone():
                self.finish(req, None)
            if (req is not None and req.finished) or ready():
                return
            await self.wait_for_change()

    # --- bookkeeping
    @property
    def running(self) -> int:
        return sum(1 for r in self.requests.values() if r.running)

    @property
    def waiting(self) -> int:
        return sum(1 for r in self.requests.values() if not r.running)

    @property
    def admits(self) -> bool:
        return self.pause_state is PauseState.UNPAUSED

    @property
    def steps(self) -> bool:
        return self.pause_state is not PauseState.PAUSED_ALL

    def add(self, req: SimRequest) -> None:
        self.requests[req.request_id] = req
        self.stats.prompt_tokens += req.prompt_tokens
        self.notify()

    def finish(self, req: SimRequest, reason: str | None) -> None:
        """End ``req``; ``None`` means its client went away (vLLM does not count those as finished)."""
        if req.finished:
            return
        req.finished = True
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        if reason is None:
            self.client_disconnects += 1
        else:
            self.stats.finished[reason] += 1
        self.notify()

    def abort(self, ids: set[str] | None = None) -> int:
        chosen = [r for r in list(self.requests.values()) if ids is None or r.request_id in ids or r.external_id in ids]
        for req in chosen:
            self.finish(req, "abort")
        return len(chosen)

    # --- the pause state machine (EngineCoreProc.pause_scheduler / resume_scheduler)
    async def pause(self, mode: str) -> None:
        self.set_pause(mode)
        if mode == "wait":
            await self.until(lambda: self.drained)

    def set_pause(self, mode: str) -> None:
        """The pause itself, without waiting for the drain: keep freezes everything, abort ends every request."""
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        if mode == "abort":
            self.abort()
        self.notify()

    @property
    def drained(self) -> bool:
        """A pause is complete: nothing steps (scheduler.get_num_unfinished_requests is 0 while PAUSED_ALL)."""
        return self.pause_state is PauseState.PAUSED_ALL or self.running == 0

    def resume(self) -> None:
        self.pause_state = PauseState.UNPAUSED
        self.notify()

    def reset(self) -> None:
        """A restart: the old process's requests are gone with it."""
        for req in list(self.requests.values()):
            req.finished = True
        self.requests.clear()
        self.pause_state = PauseState.UNPAUSED
        self.gone = False
        self.on_drained = []
        self.notify()
