"""`EngineRecord`: what we hold to be true about the engine, and how observations change it.

Sans-IO: the coordinator does the talking to vLLM and hands observations in; this module keeps the
state machine and the facts beside it (sleep level, tags still asleep, the user's pause, the weight
update session, stale weights, last error, history), and decides what an observation means. It is
synchronous throughout, so each change is atomic on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..observe.metrics import EngineMetrics
from ..upstream.elastic_ep import ElasticStatus, ElasticVerdict
from ..upstream.observation import Observation
from .persisted_facts import PersistedFacts
from .prefix_cache import Partition
from .reachability import Reachability
from .rules import WEIGHTLESS, EngineView, FailureKind, SessionTarget, Staleness, asleep_tags_for
from .states import Lifecycle, State

__all__ = ["EngineRecord", "FailureKind"]

# FAILED kinds a healthy reconcile round ends: the engine went away (or out of service) and is back.
_COMES_BACK = frozenset({FailureKind.UNREACHABLE, FailureKind.ELASTIC_EP, FailureKind.RETIRED})

log = logging.getLogger("lifeguard.lifecycle")

# The machine puts its triggers on the instance; the class holds only the typed stubs.
_SETTLE: dict[State, Callable[[Lifecycle], bool]] = {
    State.RUNNING: lambda lifecycle: lifecycle.settle_running(),
    State.PAUSED: lambda lifecycle: lifecycle.settle_paused(),
    State.SLEEPING: lambda lifecycle: lifecycle.settle_sleeping(),
    State.UPDATING_WEIGHTS: lambda lifecycle: lifecycle.settle_updating(),
    State.SCALING: lambda lifecycle: lifecycle.settle_scaling(),
    State.CHECKPOINTED: lambda lifecycle: lifecycle.settle_checkpointed(),
}


class EngineRecord:
    def __init__(
        self,
        metrics: EngineMetrics,
        on_view_change: Callable[[], None],
        on_weights_changed: Callable[[], None] = lambda: None,
        on_weights_discarded: Callable[[str], None] = lambda _why: None,
        upstream: str = "vLLM",
        on_new_weights: Callable[[str, str | None], object] = lambda _why, _label: None,
    ) -> None:
        """`on_weights_changed`: the engine's weights are not the ones they were (loaded, discarded, or the
        initial checkpoint of a restarted engine); answers recorded from the old ones no longer apply.
        `on_weights_discarded(why)`: vLLM holds no weights to serve from (a level-2 sleep, a reset, weights that fail
        their checksums): what it queued must not run on, or go on running on, them.
        `upstream`: vLLM's base URL as it may be shown. `on_new_weights(why, vllm_label)`: the weights vLLM serves are
        new ones (the weight version advances, proxy/lifecycle/weight_version.py); `vllm_label`: the label vLLM set
        itself (a restarted vLLM's `default`), else None."""
        self._metrics = metrics
        self._on_view_change = on_view_change
        self._on_weights_changed = on_weights_changed
        self._on_weights_discarded = on_weights_discarded
        self._on_new_weights = on_new_weights
        # Set at the next change of state, for whoever waits for the engine to move on (next_state_change).
        self._state_changed: asyncio.Event | None = None
        # The facts beside the state, kept where the rules read them; `state` there is filled in by view().
        self._facts = EngineView(State.STARTING)
        # The state a weight update session returns to when it is finished.
        self.return_state = State.RUNNING
        # What the open weight update session writes: the model's weights, or only its drafter's or a LoRA
        # adapter's (neither brings back weights a level-2 sleep discarded).
        self.session_target = SessionTarget.MODEL
        # The next weight-update round builds a LoRA adapter (skyrl_set_lora_receive_target armed it).
        self.adapter_round_armed = False
        # Memory was mapped back while paused (a worker RPC's wake): no canary could run, the next /resume runs it.
        self.canary_due = False
        self.failure_kind: FailureKind | None = None
        self.last_error: dict[str, Any] | None = None
        # The last few distinct errors, for the status page; a repeat of the latest one counts on it.
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)
        self.since = time.time()
        self.history_since = self.since  # the transitions (the last 50) are this record's, from its start
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self.drift_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        # What /is_scaling_elastic_ep said the last time vLLM's elastic-EP gate was up (None: not up).
        self.elastic: ElasticStatus | None = None
        # vLLM's prefix cache may hold blocks computed by older weights: admitted inference carries its salt.
        self.prefix_partition: Partition | None = None
        # A sleep or release kept the KV connector's offload tier (reset_connector=false): lifecycle/offload_tier.py.
        self.offload_tier_kept = False
        self._elastic_problem_logged: str | None = None
        self._ever_running = False
        self.reachability = Reachability(upstream)
        self.lifecycle = Lifecycle(self._on_state_change)

    @property
    def state(self) -> State:
        return self.lifecycle.state

    def view(self) -> EngineView:
        state = self.state
        reason = None
        if state is State.FAILED and self.last_error is not None:
            reason = str(self.last_error["message"])
        elif state is State.STARTING:
            reason = self.reachability.sentence
        elif state is State.SCALING and self.elastic is not None:
            reason = self.elastic.describe()
        failure = self.failure_kind if state is State.FAILED else None
        return replace(self._facts, state=state, failure=failure, reason=reason)

    # Read-only from outside: every change goes through a method below, which ends in the view change.
    @property
    def sleep_level(self) -> int | None:
        return self._facts.sleep_level

    @property
    def asleep_tags(self) -> frozenset[str]:
        return self._facts.asleep_tags

    @property
    def sleep_unconfirmed(self) -> bool:
        return self._facts.sleep_unconfirmed

    @property
    def user_pause(self) -> str | None:
        return self._facts.user_pause

    @property
    def weight_update_active(self) -> bool:
        return self._facts.weight_update_active

    @property
    def weights_stale(self) -> Staleness | None:
        return self._facts.weights_stale

    def persisted_facts(self) -> PersistedFacts:
        """What a restarted proxy could not read back from vLLM (proxy/lifecycle/state_file.py)."""
        return PersistedFacts(
            self.weights_stale,
            self.user_pause,
            tuple(sorted(self.asleep_tags)),
            self.sleep_level,
            self.sleep_unconfirmed,
            self.asleep_outside_vllm,
            self.prefix_partition,
            self.session_target.value if self.weight_update_active else None,
            self.return_state.value if self.weight_update_active else None,
            offload_tier_kept=self.offload_tier_kept,
        )

    @property
    def asleep_outside_vllm(self) -> bool:
        return self._facts.asleep_outside_vllm

    def _set(self, **facts: Any) -> None:
        self._facts = replace(self._facts, **facts)
        if not self._facts.asleep_tags and self._facts.asleep_outside_vllm:
            self._facts = replace(self._facts, asleep_outside_vllm=False)  # nothing asleep, nowhere
        self._on_view_change()

    @property
    def swapping_out_for(self) -> str | None:
        return self._facts.swapping_out_for

    # ----- facts the coordinator establishes
    @property
    def stalled_for(self) -> float | None:
        return self._facts.stalled_for

    def stall_seen(self, seconds: float | None) -> None:
        """lifecycle/stall.py's round: seconds without a byte from vLLM while requests are in flight, or None."""
        if (seconds is None) != (self._facts.stalled_for is None):
            self._set(stalled_for=seconds)
        else:
            self._facts = replace(self._facts, stalled_for=seconds)  # the same verdict: no view change

    @property
    def faulted(self) -> str | None:
        return self._facts.faulted

    def fault_seen(self, info: str | None) -> None:
        """vLLM 0.34's fault tolerance says the engine is not healthy (`info`), or healthy again (None)."""
        if info != self._facts.faulted:
            log.warning("vLLM's fault tolerance: %s", f"the engine is not healthy ({info}); inference is held"
                        if info is not None else "the engine is healthy again", extra={"event": "engine_faulted",
                        "fault_info": info})  # fmt: skip
            self._set(faulted=info)

    def swap_out(self, for_engine: str | None) -> None:
        """Drained for another engine's turn (new requests held), or (None) no longer."""
        if self._facts.swapping_out_for != for_engine:
            self._set(swapping_out_for=for_engine)

    def fell_asleep(self, level: int, *, confirmed: bool = True) -> None:
        self._set(sleep_level=level, asleep_tags=asleep_tags_for(level), sleep_unconfirmed=not confirmed)
        if level == 2:
            self.discarded()

    def discarded(self, *, end_forwarded: bool = True) -> None:
        """vLLM's weights are gone (a level-2 sleep, seen or adopted) until they are loaded again.
        `end_forwarded`: what vLLM queued must not run (False: it stays frozen until new weights are in)."""
        if end_forwarded:
            self._on_weights_discarded("the engine discarded its weights (a level-2 sleep) before this request ran")
        if self.weights_stale is not Staleness.DISCARDED:
            self.mark_stale(Staleness.DISCARDED)

    def weights_reset(self) -> None:
        """vLLM is zeroing every weight (/weight_checker reset, its reset_weights RPC): what it queued must not run,
        and nothing may run until weights are loaded again. Marked before the call is sent, like a level-2 sleep."""
        self._on_weights_discarded("the engine's weights were zeroed (a /weight_checker reset) before this request ran")
        self.mark_stale(Staleness.RESET)

    def weights_mismatched(self) -> None:
        """vLLM's own checksums say its weights are not what they must be (a wake restored other bytes): what it kept
        through the sleep must not go on running on them, and nothing may run until weights are loaded again."""
        self._on_weights_discarded("the engine's weights failed their checksums after a wake before this request ended")
        self.mark_stale(Staleness.MISMATCH)

    def weights_partial(self) -> None:
        """An /update_weights failed mid-way (some tensors written, some not, vLLM PR #57854): nothing may run on them
        until a whole update or a reload; the next generation would fail the engine."""
        self._on_weights_discarded("an /update_weights failed mid-way before this request ran")
        self.mark_stale(Staleness.PARTIAL)

    def fell_asleep_in_worker(self, tags: frozenset[str]) -> None:
        """A worker RPC freed `tags` behind vLLM's executor while the scheduler is paused (skyrl_sleep_for_weight_sync):
        the weights are discarded for the broadcast to rewrite; the requests frozen by the pause resume on them."""
        self._set(sleep_level=None, asleep_tags=tags, sleep_unconfirmed=False, asleep_outside_vllm=True)
        if "weights" in tags:
            self.discarded(end_forwarded=False)

    def released_kv_cache(self) -> None:
        """`/release_kv_cache_memory` from a completed pause: only the KV cache is gone, no sleep level."""
        self._set(sleep_level=None, asleep_tags=frozenset({"kv_cache"}), sleep_unconfirmed=False)

    def woke(self, remaining: frozenset[str]) -> None:
        """A verified wake: `remaining` is what is still asleep (nothing: fully awake, no sleep level)."""
        self._set(asleep_tags=remaining, sleep_level=self.sleep_level if remaining else None)

    def remembered_asleep(
        self, tags: frozenset[str], level: int | None, *, unconfirmed: bool, outside_vllm: bool = False
    ) -> None:
        """A restarted proxy's state file says these tags were asleep (vLLM's flags cannot tell them from a pause),
        whether the GPUs ever confirmed it, and whether a worker RPC put them to sleep behind vLLM's executor."""
        self._set(asleep_tags=tags, sleep_level=level, sleep_unconfirmed=unconfirmed, asleep_outside_vllm=outside_vllm)

    def paused_by_user(self, mode: str) -> None:
        """The user's pause, kept across a sleep/wake cycle (vLLM's /wake_up lifts it)."""
        self._set(user_pause=mode)

    def pause_lifted(self) -> None:
        self._set(user_pause=None)

    def session_opened(self, return_to: State, *, drafter: bool = False) -> None:
        self.return_state = return_to
        self.session_target = self._round_target(drafter)
        self._set(weight_update_active=True)

    def remembered_session(self, target: SessionTarget, return_to: State) -> None:
        """A restarted proxy's state file says vLLM holds a weight update session the last proxy opened."""
        self.return_state = return_to
        self.session_target = target
        self._set(weight_update_active=True)

    def session_closed(self) -> None:
        """The open session ended; the model's weights are loaded again if it wrote them."""
        target = self.session_target
        self.session_target = SessionTarget.MODEL
        self._set(weight_update_active=False)
        if target is SessionTarget.MODEL:
            self.weights_loaded("a weight update session finished")
        elif target is SessionTarget.LORA_ADAPTER:
            self.weights_committed("a weight update round rebuilt a LoRA adapter")

    def session_abandoned(self) -> None:
        """The open session ended with nothing loaded (a chunk of it failed): the weights stay as they are marked."""
        self.session_target = SessionTarget.MODEL
        self._set(weight_update_active=False)

    def single_update_written(self) -> None:
        """A /update_weights outside any session (its own): what it wrote is the model's, unless a round was armed."""
        target = self._round_target(drafter=False)
        if target is SessionTarget.MODEL:
            self.weights_loaded("/update_weights wrote the model's weights")
        elif target is SessionTarget.LORA_ADAPTER:
            self.weights_committed("a weight update round rebuilt a LoRA adapter")

    def next_session_target(self, drafter: bool) -> SessionTarget:
        """What a session opened now would write (the start's write-ahead; the armed round stays armed)."""
        return self._round_target(drafter, peek=True)

    def _round_target(self, drafter: bool, *, peek: bool = False) -> SessionTarget:
        armed = self.adapter_round_armed
        if not peek:
            self.adapter_round_armed = False
        if drafter:
            return SessionTarget.DRAFTER
        return SessionTarget.LORA_ADAPTER if armed else SessionTarget.MODEL

    def mark_stale(self, reason: Staleness) -> None:
        self._metrics.weights_stale(True)
        self._on_weights_changed()
        self._set(weights_stale=reason)

    def weights_loaded(self, why: str) -> None:
        self._on_weights_changed()
        self.weights_committed(why)
        if self.weights_stale is not None:
            self._metrics.weights_stale(False)
            self._set(weights_stale=None)

    def weights_committed(self, why: str, *, new_weights: bool = True) -> None:
        """Weights the engine serves changed (`why`): blocks of its prefix cache computed before are stale from now
        until a reset of the cache succeeds; each change gets a salt of its own. `new_weights`: False where only the
        cache is in doubt (a proxy's start), not the weights."""
        if new_weights:
            self._on_new_weights(why, None)
        log.info("prefix cache partitioned: %s", why, extra={"event": "prefix_cache_partitioned", "reason": why})
        self._partition(Partition.after(why))

    def prefix_cache_cleared(self, by: str) -> None:
        """A reset of vLLM's prefix cache succeeded (sent by `by`): no block from older weights is left."""
        if self.prefix_partition is None:
            return
        held_s = time.time() - self.prefix_partition.since
        log.info("prefix cache cleared by %s after %.1f s; requests are no longer salted", by, held_s,
                 extra={"event": "prefix_cache_cleared", "by": by, "partitioned_s": round(held_s, 3)})  # fmt: skip
        self._partition(None)

    def remembered_partition(self, partition: Partition) -> None:
        """A restarted proxy's state file says the prefix cache was partitioned: keep its salt."""
        self._partition(partition)

    def _partition(self, partition: Partition | None) -> None:
        self.prefix_partition = partition
        self._metrics.prefix_partitioned(partition is not None)
        self._on_view_change()

    def error(self, reason: str, message: str) -> None:
        now = time.time()
        self.last_error = {"reason": reason, "message": message, "at": now}
        latest = self.errors[-1] if self.errors else None
        if latest is not None and (latest["reason"], latest["message"]) == (reason, message):
            latest["at"] = now  # a STARTING engine says "/health is not 200 yet" every round
            latest["count"] += 1
        else:
            self.errors.append({"reason": reason, "message": message, "at": now, "first_at": now, "count": 1})

    def set_failed(self, kind: FailureKind, message: str) -> None:
        self.failure_kind = kind
        self.error("engine_" + kind, message)
        if self.state is not State.FAILED:
            self.lifecycle.fail()
        else:
            self._on_view_change()  # the same state for another reason: refusals say the new one

    def settle(self, state: State) -> None:
        """The one way to settle: from wherever we are (FAILED included) into `state`."""
        if self.state is State.FAILED:
            self.lifecycle.engine_back()
        if self.state is not state:
            _SETTLE[state](self.lifecycle)

    # ----- adopting what the engine really is
    def adopt(
        self, obs: Observation, *, hint: State, message: str | None = None, memory_freed: bool | None = None
    ) -> None:
        """Set our state from vLLM's flags. They cannot tell a pause from a sleep, so `hint` says which
        of the two we were near (the operation that just failed, or the state we believed).
        `memory_freed`: whether the GPUs show the sleep's memory gone (None: cannot tell)."""
        if obs.elastic is not None:
            self._adopt_elastic(obs.elastic)
            return
        self._elastic_ended()
        if not obs.reachable or not obs.healthy:
            self.set_failed(FailureKind.UNREACHABLE, message or obs.error or "/health is not 200")
            return
        if obs.checkpoint not in (None, "running"):
            self._adopt_checkpoint(obs)
            return
        if obs.sleeping is False and not obs.paused:
            self._set(asleep_tags=frozenset(), sleep_level=None, user_pause=None)
            self.settle(State.UPDATING_WEIGHTS if self.weight_update_active else State.RUNNING)
        elif (level := _gauge_sleep_level(obs, memory_freed)) is not None:
            known = self.sleep_level == level and bool(self.asleep_tags)
            if not known:
                # A sleep known from the gauge alone: it says what the last /sleep asked for, and a sleep that
                # freed nothing (a lie, or a /sleep from PAUSED) sets it too. Unless the GPUs show the memory
                # gone, it is held unconfirmed, so a repeat goes to vLLM instead of being answered as a no-op.
                unconfirmed = level >= 1 and memory_freed is not True
                self._set(sleep_level=level, asleep_tags=asleep_tags_for(level), sleep_unconfirmed=unconfirmed)
            if level == 2 and not known:
                # A level-2 sleep we did not make (or whose answer we lost): same as our own. One we knew of already
                # may have had its weights written since (a session's finish re-reads the flags: SkyRL's colocated
                # step wakes the weights, writes them, and wakes the KV cache after).
                self.discarded()
            self.settle(State.SLEEPING)
        elif hint is State.UPDATING_WEIGHTS or self.weight_update_active:
            # A session open on a paused engine (the RL path: pause keep, then the session): vLLM's flags say
            # only "paused", and a restarted proxy's state file keeps the session. It is still the session's state.
            self.settle(State.UPDATING_WEIGHTS)
        elif hint in (State.PAUSED, State.RUNNING, State.PAUSING, State.RESUMING) or obs.metric_awake:
            # Older vLLM set the gauge awake after a partial wake too: "awake" only overrides a non-sleep hint.
            # STARTING: a restarted proxy whose state file kept the tags a lying wake left asleep.
            if hint in (State.SLEEPING, State.WAKING, State.FALLING_ASLEEP, State.STARTING) and self.asleep_tags:
                self.settle(State.SLEEPING)
                return
            self._set(user_pause=self.user_pause or "abort", asleep_tags=frozenset(), sleep_level=None)
            self.settle(State.PAUSED)
        else:
            if not self.asleep_tags:
                # Asleep at a level neither our record nor vLLM's gauge tells: the weights may be discarded.
                level = self.sleep_level if self.sleep_level is not None else 1
                self._set(sleep_level=level, asleep_tags=asleep_tags_for(level))
                self.discarded()
            self.settle(State.SLEEPING)

    def _adopt_checkpoint(self, obs: Observation) -> None:
        """vLLM 0.34's `/checkpoint/status` says a process checkpoint is under way, done, or failed (nothing but a
        restart of vLLM leaves FAILED there)."""
        if obs.checkpoint == "failed":
            self.set_failed(FailureKind.CHECKPOINT, f"vLLM's process checkpoint failed: {obs.checkpoint_error}")
        else:
            self.settle(State.CHECKPOINTED)

    def _adopt_elastic(self, status: ElasticStatus) -> None:
        """vLLM's elastic-EP gate answered instead of its flags; `status` is what /is_scaling_elastic_ep said."""
        if status.problem is not None and status.problem != self._elastic_problem_logged:
            log.warning(
                "vLLM's elastic EP gate is up and its status cannot be read: %s; held as scaling",
                status.problem,
                extra={"event": "elastic_ep_status_unreadable"},
            )
        self._elastic_problem_logged = status.problem
        changed = self.elastic != status
        self.elastic = status
        verdict = status.verdict
        if verdict is ElasticVerdict.SCALING:
            self.error("engine_scaling", status.describe())
            self.settle(State.SCALING)
            if changed:
                self._on_view_change()
        else:
            self.set_failed(FailureKind.RETIRED if verdict is ElasticVerdict.RETIRED else FailureKind.ELASTIC_EP,
                            status.describe())  # fmt: skip
        if changed:
            log.warning("elastic EP: %s", status.describe(), extra={"event": "elastic_ep", **status.as_dict()})

    def _elastic_ended(self) -> None:
        if self.elastic is not None:
            log.info("elastic EP: vLLM's gate is down again", extra={"event": "elastic_ep_ended"})
        self.elastic = None
        self._elastic_problem_logged = None

    def reconcile_with(self, obs: Observation, *, memory_freed: bool | None = None, cause: str | None = None) -> None:
        """One round of the reconcile loop: engine lost, engine back, scaling, or drift. `cause`: what made the
        coordinator look now (a refusal of a forwarded request, proxy/upstream/refusals.py), kept with a drift event."""
        if obs.elastic is not None:
            self._adopt_elastic(obs.elastic)
            return
        state = self.state
        self.reachability.observed(obs)
        if state is State.SCALING:
            self._elastic_ended()
            # The scale is over: what vLLM is now is what its flags say (a scale does not change the weights).
            self.adopt(obs, hint=State.RUNNING, memory_freed=memory_freed)
            return
        if not obs.reachable or not obs.healthy:
            said = self.reachability.sentence or obs.error
            if state is State.STARTING:
                # A sidecar starts before vLLM has loaded its model: not a failure, requests are held.
                self.error("engine_starting", said or "/health is not 200 yet")
            elif state is not State.FAILED:
                self.set_failed(FailureKind.UNREACHABLE, said or "/health is not 200")
            else:
                self.failure_kind = FailureKind.UNREACHABLE
            return
        if state is State.FAILED:
            kind = self.failure_kind
            if kind not in _COMES_BACK:
                return  # healthy but broken (garbage, memory or an adapter lost): re-checked by the coordinator
            self._elastic_ended()
            self.lifecycle.engine_back()
            # Back after being gone: a restart, as far as anyone can tell; a retired rank that answers again is a new
            # process. A failed elastic-EP scale that vLLM recovered from kept its weights.
            if (kind is FailureKind.UNREACHABLE and self._ever_running) or kind is FailureKind.RETIRED:
                self._restarted()
            state = State.STARTING
        if state is State.STARTING:
            self.adopt(obs, hint=State.STARTING if obs.paused else State.RUNNING, memory_freed=memory_freed)
            return
        if state is State.UPDATING_WEIGHTS:
            return
        expected = (False, False) if state is State.RUNNING else (True, True)
        seen = (obs.sleeping, obs.paused if obs.paused is not None else obs.sleeping)
        # The flags cannot tell a sleep from a pause; vLLM's sleep-state gauge can, one way round.
        slept_while_paused = state is State.PAUSED and _gauge_sleep_level(obs, memory_freed) is not None
        checkpoint_moved = obs.checkpoint is not None and (
            (obs.checkpoint != "running") != (state is State.CHECKPOINTED) or obs.checkpoint == "failed"
        )
        if seen != expected or slept_while_paused or checkpoint_moved:
            before = state.value
            if state is State.SLEEPING and seen == (False, False):
                # Awake with no wake of ours: a wake behind our back, or a restart between two rounds (its fresh
                # checkpoint answers otherwise); the golden canary answer can no longer be vouched for.
                self._on_weights_changed()
            self.adopt(obs, hint=state, memory_freed=memory_freed)
            change: dict[str, Any] = {"before": before, "after": self.state.value, "observed": list(seen)}
            if cause is not None:
                change["cause"] = cause
            self.drift_events.append({"at": time.time(), **change})  # the log line has a timestamp of its own
            self._metrics.drift()
            log.warning("drift: vLLM's flags disagree with our state", extra={"event": "drift", **change})

    def healed(self, obs: Observation) -> None:
        """The check that failed (garbage, memory not back) passes again on an engine that never went away."""
        log.warning("the failed check passes again; engine trusted again", extra={"event": "engine_healed"})
        self.adopt(obs, hint=State.RUNNING)

    def restarted_unseen(self, why: str) -> None:
        """vLLM restarted between two reconcile rounds; only something it said gave it away."""
        self.error("engine_restarted", why)
        self._restarted()

    def _restarted(self) -> None:
        """A restarted vLLM holds its initial checkpoint, not the trained weights."""
        self._metrics.engine_restart()
        self.session_target = SessionTarget.MODEL
        self.adapter_round_armed = False
        self._set(weight_update_active=False, user_pause=None, asleep_tags=frozenset(), sleep_level=None)
        # A /health that failed and came back looks the same as a restart: weights a level-2 sleep discarded (or a
        # reset zeroed) stay so (inference held until a reload) rather than pass for a fresh checkpoint.
        if self.weights_stale not in WEIGHTLESS:
            self.mark_stale(Staleness.RESTARTED)
            self._on_new_weights("vLLM restarted: it holds its initial checkpoint", "default")
        log.warning("engine restarted; weights marked stale", extra={"event": "engine_restart"})

    # ----- state changes
    def next_state_change(self) -> asyncio.Event:
        """An event set at the engine's next change of state."""
        if self._state_changed is None:
            self._state_changed = asyncio.Event()
        return self._state_changed

    def _on_state_change(self, src: State, dst: State) -> None:
        if src is dst:
            return
        self.since = time.time()
        changed, self._state_changed = self._state_changed, None
        if changed is not None:
            changed.set()
        if dst not in (State.FALLING_ASLEEP, State.SLEEPING, State.WAKING, State.UPDATING_WEIGHTS):
            self._facts = replace(self._facts, sleep_unconfirmed=False)  # the view change follows below
        if dst is State.RUNNING:
            self._ever_running = True
        if src is State.FAILED:
            self.failure_kind = None
        self.history.append({"from": src.value, "to": dst.value, "at": self.since})
        self._metrics.state_changed(src.value, dst.value)
        extra = {"event": "state_change", "from_state": src.value, "to_state": dst.value}
        if dst is State.FAILED and self.last_error is not None:  # set_failed records why just before
            log.warning("state %s -> %s: %s", src.value, dst.value, self.last_error["message"],
                        extra={**extra, "reason": self.last_error["reason"]})  # fmt: skip
        else:
            log.info("state %s -> %s", src.value, dst.value, extra=extra)
        self._on_view_change()

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "since": self.since,
            "sleep_level": self.sleep_level,
            "asleep_tags": sorted(self.asleep_tags),
            "sleep_unconfirmed": self.sleep_unconfirmed,
            "paused": self.user_pause is not None or self.state in (State.PAUSED, State.PAUSING),
            "pause_mode": self.user_pause,
            "asleep_outside_vllm": self.asleep_outside_vllm,
            "weight_update_active": self.weight_update_active,
            "weight_update_target": self.session_target.value if self.weight_update_active else None,
            "weights_stale": self.weights_stale is not None,
            "weights_stale_reason": self.weights_stale,
            "prefix_cache": _prefix_view(self.prefix_partition),
            "offload_tier_kept": self.offload_tier_kept,
            "swapping_out_for": self.swapping_out_for,
            "last_error": self.last_error,
            "upstream_unreachable": self.reachability.snapshot(),
            "recent_errors": [dict(e) for e in self.errors],
            "failure": self.failure_kind if self.state is State.FAILED else None,
            "elastic_ep": self.elastic.as_dict() if self.elastic is not None else None,
            "transitions": list(self.history),
            "history_since": self.history_since,
            "drift_events": list(self.drift_events),
            # The proxy's clock when this was read: a page on another machine draws the transitions' `at` against it.
            "read_at": time.time(),
        }


def _prefix_view(partition: Partition | None) -> dict[str, Any]:
    if partition is None:
        return {"partitioned": False, "since": None, "reason": None, "salt": None}
    return {"partitioned": True, **partition.as_dict()}


def _gauge_sleep_level(obs: Observation, memory_freed: bool | None) -> int | None:
    """The level vLLM's sleep-state gauge says, unless the GPUs contradict it. The gauge is only written by /sleep and
    /wake_up, so a sleep that answered 200 without sleeping leaves it saying "asleep" through later pauses
    (chaos run, lie-asleep then /pause): a paused engine taken for a sleeping one gets its /sleep no-op'd."""
    level = obs.metric_level
    if obs.metric_awake is not False or level is None:
        return None
    return level if level == 0 or memory_freed is not False else None
