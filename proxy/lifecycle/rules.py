"""The rules table of lifecycle calls, as pure functions of a snapshot of our state.

`judge` says, before anything is sent, whether a call is a no-op (answered by us; vLLM's own repeats
are not harmless: a repeated `/sleep` aborts requests queued during sleep), refused (409/503), merely
recorded, or must run. `admission` says what the gate does with inference in a given snapshot, and
`serving_refusal` says, from `admission` itself, why a request sent now would not be forwarded at once
(`/lifeguard/serving`, the readiness routers follow). Nothing here does I/O; the hypothesis model test
drives these directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    AlreadyAsleep,
    CheckpointPrepared,
    EngineAsleep,
    EngineRetired,
    EngineScaling,
    EngineUnavailable,
    LifeguardError,
    NotPaused,
    NotServing,
    NoWeightUpdateSession,
    WeightsAsleep,
    WeightUpdateActive,
    WeightUpdateInProgress,
)
from .parsed_calls import LifecycleCall
from .states import State
from .worker_rpcs import RpcKind, noop_reply

ALL_SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class SessionTarget(enum.StrEnum):
    """What a weight update session writes (`weight_update_target` in /lifeguard/state)."""

    MODEL = "model"
    DRAFTER = "drafter"  # /start_draft_weight_update: vLLM's speculative-decoding drafter
    LORA_ADAPTER = "lora_adapter"  # a round armed by skyrl_set_lora_receive_target


class Staleness(enum.StrEnum):
    """Why the weights vLLM holds are not the intended ones, until weights are loaded again."""

    DISCARDED = "discarded"  # a level-2 sleep threw them away
    RESTARTED = "restarted"  # a restarted vLLM holds its initial checkpoint
    RESET = "reset"  # /weight_checker {"action": "reset"} (vLLM's reset_weights) set every weight to zero
    # vLLM's own checksums (/weight_checker) say the weights are not what they must be: a level-1 wake restored
    # other bytes, or a reload did not produce the checkpoint (proxy/lifecycle/weight_checksums.py)
    MISMATCH = "mismatch"
    # An /update_weights failed mid-way: some tensors are new, some old or on the meta device (weight_version.py)
    PARTIAL = "partial"


#: Staleness under which vLLM holds no weights to serve from: inference is held until weights are loaded again.
WEIGHTLESS = frozenset({Staleness.DISCARDED, Staleness.RESET, Staleness.MISMATCH, Staleness.PARTIAL})


class FailureKind(enum.StrEnum):
    """Why the engine is FAILED: gone, up but broken in a way a re-check can clear, or out of service."""

    UNREACHABLE = "unreachable"
    GARBAGE = "garbage"
    MEMORY = "memory"
    # A LoRA adapter served before a sleep is gone, or answers like the base model, after the wake (vLLM #53888).
    LORA = "lora"
    # vLLM 0.34's process checkpoint failed (its CheckpointState FAILED): only a restart of vLLM leaves it.
    CHECKPOINT = "checkpoint"
    # vLLM's elastic-EP scale failed and it keeps its gate up (phase "failed").
    ELASTIC_EP = "elastic_ep"
    # An elastic-EP scale-down retired this data-parallel rank: it answers nothing but /health until it is stopped.
    RETIRED = "retired"


@dataclass(frozen=True)
class EngineView:
    """What we hold to be true about the engine, besides the state itself."""

    state: State
    sleep_level: int | None = None
    asleep_tags: frozenset[str] = frozenset()
    user_pause: str | None = None
    weight_update_active: bool = False
    weights_stale: Staleness | None = None
    # Asleep by vLLM's flags, but the GPUs showed nothing freed: maybe only paused (a sleep that lied),
    # maybe asleep without freeing. A repeat is sent again rather than answered from this belief.
    sleep_unconfirmed: bool = False
    # Being drained to be put to sleep for another engine's turn (proxy/sharing/arbiter.py): the engine it is for.
    swapping_out_for: str | None = None
    # The asleep tags were put to sleep by a worker RPC (skyrl_sleep_for_weight_sync, proxy/lifecycle/worker_rpcs.py)
    # behind vLLM's executor: vLLM's /sleep, /wake_up and /resume know nothing of it.
    asleep_outside_vllm: bool = False
    # FAILED or SCALING: why, for the refusals (the record's last error message); STARTING: that vLLM cannot be
    # reached, and how (lifecycle/reachability.py).
    failure: FailureKind | None = None
    reason: str | None = None
    # Seconds with requests in flight and no byte from vLLM, once past `stall_after_s` (lifecycle/stall.py).
    stalled_for: float | None = None
    # vLLM 0.34's fault tolerance says the engine is not healthy (lifecycle/fault_tolerance.py): what it said.
    faulted: str | None = None


@dataclass(frozen=True)
class Noop:
    body: dict[str, Any]


@dataclass(frozen=True)
class Refuse:
    error: LifeguardError


@dataclass(frozen=True)
class Defer:
    """Accepted without calling vLLM: a `/pause` while asleep becomes the user pause, re-applied on wake."""

    body: dict[str, Any] = field(default_factory=lambda: {"status": "paused"})


@dataclass(frozen=True)
class Run:
    pass


Decision = Noop | Refuse | Defer | Run


#: The calls that open a weight update session: on the model, or on its speculative-decoding drafter.
START_OPERATIONS = ("start_weight_update", "start_draft_weight_update")


def asleep_tags_for(level: int) -> frozenset[str]:
    return frozenset({"scheduling"}) if level == 0 else ALL_SLEEP_TAGS


def wake_targets(call: LifecycleCall, view: EngineView) -> frozenset[str]:
    """The tags this wake would actually wake; vLLM leaves the scheduler paused until all are awake."""
    if view.asleep_tags == {"scheduling"}:
        return view.asleep_tags  # vLLM resumes a level-0 sleep on any wake
    wanted = frozenset(call.tags) if call.tags is not None else ALL_SLEEP_TAGS
    return wanted & view.asleep_tags


def judge(call: LifecycleCall, view: EngineView, weight_rpc_methods: frozenset[str] = frozenset()) -> Decision:
    """`weight_rpc_methods`: the /collective_rpc methods that read or write the weights."""
    state = view.state
    if state in (State.STARTING, State.FAILED, State.SCALING):
        return Refuse(unavailable(view))
    in_update = state is State.UPDATING_WEIGHTS
    op = call.op
    if op in CHECKPOINT_OPERATIONS or state is State.CHECKPOINTED:
        return _judge_in_checkpoint(call, view)
    rpc_kind = call.rpc_kind if op == "collective_rpc" else None
    worker_sleep = rpc_kind in (RpcKind.SLEEP_FOR_SYNC, RpcKind.WAKE_FOR_SYNC)
    if (op in ("sleep", "wake_up", "pause", "resume", "release_kv_cache_memory") or worker_sleep) and in_update:
        what = call.rpc_method if worker_sleep else f"/{op}"
        return Refuse(
            WeightUpdateInProgress(
                f"a weight update session is open; call /finish_weight_update before {what}",
            )
        )
    if rpc_kind is RpcKind.SLEEP_FOR_SYNC:
        return _judge_sleep_for_sync(view)
    if rpc_kind is RpcKind.WAKE_FOR_SYNC:
        return _judge_wake_for_sync(call, view)
    if view.asleep_outside_vllm and op in ("sleep", "wake_up", "release_kv_cache_memory"):
        return Refuse(_asleep_outside_vllm(op))
    if op == "release_kv_cache_memory":
        return _judge_release(view)
    if op == "sleep":
        if state is State.SLEEPING and view.sleep_level is None:
            return Run()  # only the KV cache was released: the weights are still resident
        if state is State.SLEEPING:
            if view.sleep_level == call.level:
                return Run() if view.sleep_unconfirmed else Noop({"status": "sleeping", "level": call.level})
            return Refuse(
                AlreadyAsleep(
                    f"the engine is asleep at level {view.sleep_level}; wake it before sleeping at level {call.level}",
                )
            )
        return Run()
    if op == "wake_up":
        tags = list(call.tags) if call.tags is not None else None
        if state is State.SLEEPING:
            return Run() if wake_targets(call, view) else Noop({"status": "sleeping", "tags": tags})
        return Noop({"status": "awake", "tags": tags})
    if op == "pause":
        if state is State.RUNNING:
            return Run()
        if state is State.SLEEPING:
            return Defer()
        return Noop({"status": "paused"})
    if op == "resume":
        if state is State.PAUSED:
            return Run()
        if state is State.SLEEPING:
            wake = "skyrl_wake_for_weight_sync" if view.asleep_outside_vllm else "/wake_up"
            return Refuse(
                EngineAsleep(
                    f"the engine is asleep; /resume would schedule on freed memory - call {wake}",
                )
            )
        return Noop({"status": "resumed"})
    if op in START_OPERATIONS and view.weight_update_active:
        return Refuse(
            WeightUpdateActive(
                "a weight update session is already open; call /finish_weight_update first",
            )
        )
    touches_weights = op in (*START_OPERATIONS, "update_weights") or (
        op == "collective_rpc" and call.rpc_method in weight_rpc_methods
    )
    if touches_weights and "weights" in view.asleep_tags:
        return Refuse(
            WeightsAsleep(
                "the weights are asleep; wake them (/wake_up?tags=weights) before updating them",
            )
        )
    if op == "finish_weight_update" and not view.weight_update_active:
        return Refuse(
            NoWeightUpdateSession(
                "no weight update session is open; call /start_weight_update first",
            )
        )
    return Run()


#: vLLM 0.34's process-checkpoint calls (`/checkpoint/prepare`, `/checkpoint/restore`).
CHECKPOINT_OPERATIONS = ("checkpoint_prepare", "checkpoint_restore")


def _judge_in_checkpoint(call: LifecycleCall, view: EngineView) -> Decision:
    """A checkpoint call, or any call while the engine is prepared for one: vLLM's EngineCore refuses to sleep, wake or
    resume until a restore (a 500 to the client), and its prepare needs an awake engine (a 400)."""
    state, op = view.state, call.op
    if op == "checkpoint_restore":
        return Run() if state is State.CHECKPOINTED else Noop({"state": "running"})  # vLLM: a restore is idempotent
    if op == "checkpoint_prepare":
        if state is State.CHECKPOINTED:
            return Noop({"state": "prepared"})
        if state is State.SLEEPING:
            return Refuse(EngineAsleep("the engine is asleep; vLLM prepares a checkpoint only from an awake engine"))
        if state is State.UPDATING_WEIGHTS:
            why = "a weight update session is open; call /finish_weight_update before /checkpoint/prepare"
            return Refuse(WeightUpdateInProgress(why))
        return Run()
    if op == "pause":
        return Defer()  # vLLM's restore resumes scheduling: the pause is applied again after it
    what = call.rpc_method if op == "collective_rpc" else f"/{op}"
    return Refuse(
        CheckpointPrepared(f"the engine is prepared for a process checkpoint; POST /checkpoint/restore before {what}")
    )


def _judge_sleep_for_sync(view: EngineView) -> Decision:
    """SkyRL's `skyrl_sleep_for_weight_sync` frees the pools under the scheduler: only a paused one is safe."""
    if view.state is State.PAUSED:
        return Run()
    if view.state is State.SLEEPING and view.asleep_outside_vllm:
        if view.asleep_tags >= ALL_SLEEP_TAGS:
            return Noop(noop_reply())  # a repeat would unmap what is already unmapped
        return Refuse(
            AlreadyAsleep(
                f"{sorted(view.asleep_tags)} still sleep for a weight sync; wake them (skyrl_wake_for_weight_sync) "
                "before sleeping the engine's memory again",
            )
        )
    if view.state is State.SLEEPING:
        return Refuse(
            AlreadyAsleep(
                "the engine sleeps through /sleep; skyrl_sleep_for_weight_sync would sleep its memory a second time",
            )
        )
    return Refuse(
        NotPaused(
            "skyrl_sleep_for_weight_sync frees the weights and KV cache under the scheduler: pause first "
            "(/pause?mode=keep, as SkyRL's weight sync does)",
        )
    )


def _judge_wake_for_sync(call: LifecycleCall, view: EngineView) -> Decision:
    """`skyrl_wake_for_weight_sync` maps back what `skyrl_sleep_for_weight_sync` freed, and nothing else."""
    if view.state is State.SLEEPING and view.asleep_outside_vllm:
        wanted = call.rpc.tags if call.rpc is not None else ALL_SLEEP_TAGS
        return Run() if wanted & view.asleep_tags else Noop(noop_reply())
    if view.state is State.SLEEPING:
        return Refuse(
            EngineAsleep(
                "the engine sleeps through /sleep: wake it with /wake_up; skyrl_wake_for_weight_sync would map its "
                "memory behind vLLM's executor, which would still believe it asleep",
            )
        )
    # Nothing we know of is asleep, but a worker sleep we did not see (a proxy restarted without its state file)
    # reads exactly the same: vLLM's own answer decides, and the call changes nothing of ours.
    return Run()


def _asleep_outside_vllm(op: str) -> LifeguardError:
    if op == "wake_up":
        return EngineAsleep(
            "the weights and KV cache sleep for a weight sync (skyrl_sleep_for_weight_sync): vLLM's /wake_up does "
            "not know it and would resume scheduling on freed memory; wake them with skyrl_wake_for_weight_sync",
        )
    return AlreadyAsleep(
        f"the weights and KV cache sleep for a weight sync (skyrl_sleep_for_weight_sync); wake them with "
        f"skyrl_wake_for_weight_sync before /{op}",
    )


def _judge_release(view: EngineView) -> Decision:
    """vLLM's EngineCore.release_kv_cache_memory needs a completed pause and every allocation resident."""
    if view.state is State.PAUSED:
        return Run()
    if view.state is State.SLEEPING and view.asleep_tags == {"kv_cache"}:
        return Noop({"status": "kv_cache_released"})
    if view.state is State.SLEEPING:
        return Refuse(
            AlreadyAsleep(
                "the engine is asleep; /release_kv_cache_memory needs the weights and KV cache resident",
            )
        )
    return Refuse(NotPaused("/release_kv_cache_memory needs a completed pause: call /pause first"))


def unavailable(view: EngineView) -> LifeguardError:
    """The error for a call the engine cannot take in its state (STARTING, FAILED, SCALING), saying why."""
    why = f": {view.reason}" if view.reason else ""
    if view.state is State.SCALING:
        return EngineScaling(f"the engine is scaling; calls wait until it has scaled{why}")
    if view.failure is FailureKind.RETIRED:
        return EngineRetired(f"the engine is out of service{why}")
    return EngineUnavailable(f"the engine is not available (state {view.state.value}){why}")


def control_refusal(view: EngineView) -> LifeguardError | None:
    """Why a control call (route kinds AT_ONCE and SERIALIZED) may not be forwarded now, if it may not. A lost LoRA
    adapter is put back with one (/v1/load_lora_adapter), so that failure lets them through."""
    if view.state is State.FAILED and view.failure is not FailureKind.LORA:
        why = f": {view.reason}" if view.reason else ""
        if view.failure is FailureKind.RETIRED:
            return EngineRetired(f"the engine is out of service; control calls are refused{why}")
        return EngineUnavailable(f"the engine has failed; control calls are refused until it is back{why}")
    return None


class Admission(enum.Enum):
    FORWARD = "forward"
    HOLD = "hold"
    REJECT_FAILED = "reject_failed"
    REJECT_SLEEPING = "reject_sleeping"


def admission(view: EngineView, *, on_sleeping: str, hold_while_restarted: bool) -> Admission:
    """What the gate does with a new inference request in this snapshot."""
    if view.state is State.FAILED:
        return Admission.REJECT_FAILED
    if view.state is State.RUNNING:
        if (
            view.swapping_out_for is not None
            or view.faulted is not None
            or view.weights_stale in WEIGHTLESS
            or (view.weights_stale is Staleness.RESTARTED and hold_while_restarted)
        ):
            return Admission.HOLD
        return Admission.FORWARD
    if view.state is State.SLEEPING and on_sleeping == "reject":
        return Admission.REJECT_SLEEPING
    return Admission.HOLD


#: Why an engine is not serving (`NotServing.cause`, in `/lifeguard/serving`'s 503 body).
NOT_SERVING_CAUSES = (
    "shutting_down",
    "failed",
    "starting",
    "asleep",
    "falling_asleep",
    "waking",
    "paused",
    "updating_weights",
    "weights_discarded",
    "weights_reset",
    "weights_mismatch",
    "weights_partial",
    "weights_stale",
    "swapping_out",
    "scaling",
    "checkpoint",
    "stalled",
    "faulted",
)

_NOT_SERVING_IN: dict[State, tuple[str, str]] = {
    State.FAILED: ("failed", "the engine has failed; inference is refused (503 engine_unavailable) until it is back"),
    State.STARTING: ("starting", "the engine has not been seen ready yet; inference is held"),
    State.FALLING_ASLEEP: ("falling_asleep", "the engine is going to sleep; inference is held until a wake"),
    State.WAKING: ("waking", "the engine is waking; inference is held until the wake is verified"),
    State.PAUSING: ("paused", "the engine is pausing; inference is held until /resume"),
    State.PAUSED: ("paused", "the engine is paused; inference is held until /resume"),
    State.RESUMING: ("paused", "the engine is resuming; inference is held until the resume is verified"),
    State.UPDATING_WEIGHTS: ("updating_weights", "a weight update is in progress; inference is held until it ends"),
    State.SCALING: ("scaling", "vLLM's elastic EP is scaling; inference is held until it ends"),
    State.PREPARING_CHECKPOINT: ("checkpoint", "the engine is preparing a process checkpoint; inference is held"),
    State.CHECKPOINTED: (
        "checkpoint",
        "the engine is prepared for a process checkpoint; inference is held until /checkpoint/restore is verified",
    ),
    State.RESTORING: ("checkpoint", "the engine is restoring from a checkpoint; inference is held until it is checked"),
}


def serving_refusal(
    view: EngineView, *, on_sleeping: str, hold_while_restarted: bool, closed: bool
) -> NotServing | None:
    """Why an inference request sent now would not be forwarded at once, if it would not (`closed`: the gate
    is shutting down). The yes/no is `admission`'s own, so a router that follows this sends nothing the gate
    would hold or refuse; the rest only names the cause. A wake's release of held requests (a few loop turns,
    `gate.RELEASE_BATCH` at a time) is not "held": newcomers wait behind it, but the engine is serving."""
    state = view.state
    if closed:
        return NotServing("the proxy is shutting down; inference is refused", state=state.value, cause="shutting_down")
    if admission(view, on_sleeping=on_sleeping, hold_while_restarted=hold_while_restarted) is Admission.FORWARD:
        if view.stalled_for is not None:  # forwarded, but nothing comes back: routers send elsewhere
            why = f"requests are in flight and vLLM has sent no byte for {view.stalled_for:.0f} s; it may be stalled"
            return NotServing(why, state=state.value, cause="stalled")
        return None
    if state is State.SLEEPING:
        level = "its KV cache released" if view.sleep_level is None else f"level {view.sleep_level}"
        then = {
            "reject": "inference is refused (503 engine_sleeping)",
            "wake": "a request sent to it is held and wakes it",
        }.get(on_sleeping, "inference is held until a wake")
        return NotServing(f"the engine is asleep ({level}); {then}", state=state.value, cause="asleep")
    if state is State.RUNNING and view.faulted is not None:
        why = f"vLLM's fault tolerance says the engine is not healthy ({view.faulted}); inference is held until it is"
        return NotServing(why, state=state.value, cause="faulted")
    if state is State.RUNNING:  # awake, with weights that may not serve, or making room for another engine
        if view.swapping_out_for is not None:
            why = f"finishing what it serves, to be put to sleep for {view.swapping_out_for}'s turn; inference is held"
            return NotServing(why, state=state.value, cause="swapping_out")
        if view.weights_stale is Staleness.DISCARDED:
            why = "a level-2 sleep discarded the weights; inference is held until they are loaded again"
            return NotServing(why, state=state.value, cause="weights_discarded")
        if view.weights_stale is Staleness.RESET:
            why = "/weight_checker reset set every weight to zero; inference is held until weights are loaded again"
            return NotServing(why, state=state.value, cause="weights_reset")
        if view.weights_stale is Staleness.MISMATCH:
            why = "vLLM's weight checksums are not what they must be; inference is held until weights are loaded again"
            return NotServing(why, state=state.value, cause="weights_mismatch")
        if view.weights_stale is Staleness.PARTIAL:
            why = "an /update_weights failed mid-way; inference is held until a whole weight update or a reload"
            return NotServing(why, state=state.value, cause="weights_partial")
        why = "vLLM restarted and holds its initial checkpoint; inference is held until a weight update or reload"
        return NotServing(why, state=state.value, cause="weights_stale")
    cause, why = _NOT_SERVING_IN[state]
    if state is State.STARTING and view.reason is not None:  # vLLM cannot be reached: the reconcile log's sentence
        why = f"{view.reason}; inference is held until it answers"
    return NotServing(why, state=state.value, cause=cause)
