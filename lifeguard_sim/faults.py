"""Fault specs (``OP:KIND[@N|@pP]``) and the book that decides, call by call, which one fires.

``@N`` arms a fault for the next N calls of OP, ``@pP`` fires it with probability P on every call (drawn
from a seeded RNG, so a run is reproducible), and no suffix means exactly once. ``slow:S`` adds to
whatever else fires; of the other kinds the first armed one that fires wins.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

OPS: tuple[str, ...] = (
    "sleep",
    "wake_up",
    "pause",
    "resume",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "collective_rpc",
    "fetch_weights",
    "generate",
    "scale_elastic_ep",
    "checkpoint_prepare",
    "checkpoint_restore",
    "reset_prefix_cache",
)

KINDS: dict[str, str] = {
    "error500": "answer 500 with vLLM's body ('Call to wake_up method failed: CUDA Error: out of "
    "memory at ...'); engine state unchanged",
    "wedge": "like error500, and every later call of the same OP fails too (the field report after a "
    "wake OOM); only a restart clears it",
    "crash": "the process exits non-zero in the middle of the operation (callers see a connection reset)",
    "hang": "the call never answers, until the process is stopped",
    "lie-asleep": "answer 200 as if it worked, but nothing changes (a wake leaves the engine asleep: "
    "is_sleeping true, memory not restored)",
    "lie-memory": "answer 200 and flip the flags, but GPU memory does not move (only the GPU file / NVML "
    "shows it); sleep and wake_up only",
    "lie-dead": "answer 200, then the engine is dead: /health 503, generation 500 EngineDeadError, and "
    "the process exits about 5 s later (vLLM's watchdog)",
    "garbage": "after the operation, completions return degenerate text (token id 0 '!' repeated) with "
    "NaN logprobs, until weights are reloaded or the engine restarts",
    "lose-lora": "wake_up only: the wake works, but every LoRA adapter loaded before it lost its weights: still "
    "listed by /v1/models, it answers like the base model (vLLM #53888), until it is loaded again",
    "retire": "scale_elastic_ep only (0.33): the scale retires this data-parallel rank: /health 200, every other "
    "path 503 'This data-parallel rank has been retired...'",
    "scale-fails": "scale_elastic_ep only: the commit fails: 500 'Scale failed', the scaling gate stays up and "
    "/is_scaling_elastic_ep says phase 'failed' with the error",
    "lie-weights": "sleep, wake_up and collective_rpc only: answer 200 and work, but one weight tensor holds other "
    "bytes than it must (a level-1 sleep's CPU copy, or the wake, restores other weights than were put to sleep; a "
    "reload_weights reads a checkpoint file changed on disk); greedy answers are unchanged, only /weight_checker's "
    "checksums tell",
    "partial": "update_weights only: the chunk fails mid-way (500, the IPC engine's 'IPC handle not found for GPU "
    "UUID ...'): the worker ends the session and the weights are partial (parameters left on the meta device); the "
    "next model step kills the engine (EngineDeadError), unless a finished new session or a reload replaces them",
    "freed-500": "sleep only: the memory is freed, then the sleep answers 500 'Memory usage increased after "
    "sleeping.' (Worker.sleep's assertion, tripped by a neighbour allocating on a shared GPU): /is_sleeping true, the "
    "executor still counts itself awake, so the next /wake_up is a 200 no-op and a generation then reads unmapped "
    "weights and kills the engine; a sleep sent again completes it",
    "stall:S": "generate only: for S seconds no request makes progress (accepted, running, no bytes) while /health "
    "answers 200",
    "engine-fault": "generate only: the engine core's busy loop raises mid-generation (a NCCL timeout): the engine "
    "dies (EngineDeadError), or with --enable-fault-tolerance (0.34) running requests are aborted, the engine is "
    "unhealthy and refuses requests 503 EngineFaultedError until a /v1/fault_tolerance/apply retry",
    "checkpoint-fails": "checkpoint_prepare and checkpoint_restore only (0.34): the worker's checkpoint step raises: "
    "the checkpoint state is FAILED with the error (a prepare still answers 200 with it, a restore 500); only a "
    "restart leaves FAILED",
    "slow:S": "the operation takes S seconds longer (combines with any other fault)",
}

_MEMORY_OPS = frozenset({"sleep", "wake_up"})
# Kinds that only mean something for one operation.
_ONLY_FOR: dict[str, tuple[str, ...]] = {
    "lose-lora": ("wake_up",),
    "retire": ("scale_elastic_ep",),
    "scale-fails": ("scale_elastic_ep",),
    "lie-weights": ("sleep", "wake_up", "collective_rpc"),
    "partial": ("update_weights",),
    "freed-500": ("sleep",),
    "stall": ("generate",),
    "engine-fault": ("generate",),
    "checkpoint-fails": ("checkpoint_prepare", "checkpoint_restore"),
}
# Kinds that take seconds (`KIND:S`).
_TIMED = ("slow", "stall")
_LIFECYCLE_ONLY = frozenset({"lie-asleep", "lie-memory"})


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the spec."""


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``OP:KIND[@N|@pP]``."""

    text: str
    op: str
    kind: str
    seconds: float = 0.0
    times: int | None = 1
    probability: float | None = None


@dataclass(frozen=True)
class Fired:
    """What fires for one call: at most one kind (with its seconds, for ``stall``), plus any extra latency from
    ``slow``."""

    kind: str | None = None
    extra_seconds: float = 0.0
    seconds: float = 0.0


NOTHING = Fired()


def parse_fault(text: str) -> FaultSpec:
    """Parse one spec, raising ``FaultSpecError`` naming it when it is malformed."""
    head, at, suffix = text.strip().partition("@")
    op, colon, kind = head.partition(":")
    if not colon or op not in OPS:
        raise FaultSpecError(f"bad fault spec {text!r}: OP must be one of {', '.join(OPS)}")
    seconds = 0.0
    timed, colon_s, raw_seconds = kind.partition(":")
    if timed in _TIMED and colon_s:
        seconds = _number(text, raw_seconds, f"{timed}:S needs seconds")
        if seconds < 0:
            raise FaultSpecError(f"bad fault spec {text!r}: {timed}:S needs S >= 0")
        kind = timed
    elif kind not in KINDS:
        names = ", ".join(KINDS)
        raise FaultSpecError(f"bad fault spec {text!r}: KIND must be one of {names}")
    if kind in _LIFECYCLE_ONLY and op == "generate":
        raise FaultSpecError(f"bad fault spec {text!r}: {kind} has no meaning for generate")
    if kind in _ONLY_FOR and op not in _ONLY_FOR[kind]:
        raise FaultSpecError(f"bad fault spec {text!r}: {kind} applies to {' and '.join(_ONLY_FOR[kind])} only")
    if kind == "lie-memory" and op not in _MEMORY_OPS:
        raise FaultSpecError(f"bad fault spec {text!r}: lie-memory applies to sleep and wake_up only")
    times: int | None = 1
    probability: float | None = None
    if at and suffix.startswith("p"):
        times = None
        probability = _number(text, suffix[1:], "@pP needs a probability")
        if not 0.0 < probability <= 1.0:
            raise FaultSpecError(f"bad fault spec {text!r}: @pP needs 0 < P <= 1")
    elif at:
        if not suffix.isdigit() or int(suffix) < 1:
            raise FaultSpecError(f"bad fault spec {text!r}: @N needs a whole number N >= 1")
        times = int(suffix)
    return FaultSpec(text.strip(), op, kind, seconds, times, probability)


def _number(text: str, raw: str, why: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise FaultSpecError(f"bad fault spec {text!r}: {why}") from None


@dataclass
class _Armed:
    spec: FaultSpec
    remaining: int | None


class FaultBook:
    """The active faults. ``draw(op)`` consumes what fires for one call of ``op``."""

    def __init__(self, seed: int, specs: Iterable[str] = ()) -> None:
        self._rng = random.Random(seed)
        self._armed: list[_Armed] = []
        self.replace(specs)

    def replace(self, specs: Iterable[str]) -> None:
        """Swap in a new list; nothing changes unless every spec parses."""
        parsed = [parse_fault(text) for text in specs]
        self._armed = [_Armed(spec, spec.times) for spec in parsed]

    def active(self) -> list[dict[str, object]]:
        return [
            {
                "spec": armed.spec.text,
                "op": armed.spec.op,
                "kind": armed.spec.kind,
                "remaining": armed.remaining,
                "probability": armed.spec.probability,
            }
            for armed in self._armed
        ]

    def draw(self, op: str) -> Fired:
        kind: str | None = None
        extra = seconds = 0.0
        for armed in list(self._armed):
            spec = armed.spec
            if spec.op != op or (kind is not None and spec.kind != "slow"):
                continue
            if spec.probability is not None and self._rng.random() >= spec.probability:
                continue
            if armed.remaining is not None:
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._armed.remove(armed)
            if spec.kind == "slow":
                extra += spec.seconds
            else:
                kind, seconds = spec.kind, spec.seconds
        return Fired(kind, extra, seconds) if kind or extra else NOTHING
