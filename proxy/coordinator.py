"""`LifecycleCoordinator`: the one owner of the lifecycle state; it alone decides and acts.

Rule (llama-swap #946): a state read that gates a mutation happens in here, under the one lock.
Everyone else gets `snapshot()` and treats it as advisory.

Each lifecycle call runs as a coordinator-owned task (a client that hangs up does not cancel a wake
half-way): wait its turn on the lock (FIFO, with a deadline) -> judge it against the state it finds
(rules.judge) -> begin trigger (the gate starts holding) -> upstream call, watched for engine death ->
verify -> settle trigger, or adopt what the engine really is and answer 503. An identical call that
arrives while one is pending joins it and gets the same outcome, because vLLM's own repeats are not
harmless (a repeated /sleep aborts the requests queued during sleep).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .calls import LifecycleCall
from .config import Settings
from .errors import (
    InvalidTransition,
    LifecycleBusy,
    LifeguardError,
    UpstreamBadStatus,
    UpstreamError,
    UpstreamUnreachable,
    VerificationFailed,
)
from .gate import RequestGate
from .metrics import Metrics
from .probes import Expectation, Verdict, Verifier
from .rules import EngineView, Noop, Record, Refuse, admission, asleep_tags_for, judge, wake_targets
from .states import Lifecycle, State
from .tasks import spawn
from .upstream import Observation, Reply, VllmClient

log = logging.getLogger("lifeguard.lifecycle")
T = TypeVar("T")

_OUTCOME_OF = {
    "bad_parameter": "invalid",
    "lifecycle_busy": "busy",
    "verification_failed": "verification_failed",
    "unauthorized": "unauthorized",
    "forbidden": "unauthorized",
}


@dataclass
class OpResult:
    """What the client of a lifecycle call gets back when it did not fail."""

    status: int
    body: bytes
    content_type: str | None
    headers: dict[str, str] = field(default_factory=dict)
    outcome: str = "ok"


def _json_result(body: dict[str, Any], outcome: str, **headers: str) -> OpResult:
    import json

    return OpResult(200, json.dumps(body).encode(), "application/json", dict(headers), outcome)


class LifecycleCoordinator:
    def __init__(
        self, settings: Settings, client: VllmClient, verifier: Verifier, gate: RequestGate, metrics: Metrics
    ) -> None:
        self._settings = settings
        self._client = client
        self._verifier = verifier
        self._gate = gate
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...], bytes], asyncio.Future[OpResult]] = {}
        self.sleep_level: int | None = None
        self.asleep_tags: frozenset[str] = frozenset()
        self.user_pause: str | None = None
        self.weight_update_active = False
        self.weights_stale: str | None = None
        self.last_error: dict[str, Any] | None = None
        self.failure_kind: str | None = None
        self.since = time.time()
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self.drift_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._return_state = State.RUNNING
        self._ever_running = False
        self.lifecycle = Lifecycle(self._on_state_change)
        self._refresh_gate()

    # ----- reading
    @property
    def state(self) -> State:
        return self.lifecycle.state

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def view(self) -> EngineView:
        return EngineView(
            self.state,
            self.sleep_level,
            self.asleep_tags,
            self.user_pause,
            self.weight_update_active,
            self.weights_stale,
        )

    def snapshot(self) -> dict[str, Any]:
        """The public state (`GET /lifeguard/state`); advisory for anyone but the coordinator."""
        last = self._verifier.last
        memory = self._verifier.last_memory
        return {
            "state": self.state.value,
            "since": self.since,
            "sleep_level": self.sleep_level,
            "asleep_tags": sorted(self.asleep_tags),
            "paused": self.user_pause is not None or self.state in (State.PAUSED, State.PAUSING),
            "pause_mode": self.user_pause,
            "weight_update_active": self.weight_update_active,
            "weights_stale": self.weights_stale is not None,
            "weights_stale_reason": self.weights_stale,
            "held_requests": self._gate.held,
            "inflight_requests": self._gate.inflight,
            "lifecycle_busy": self.busy,
            "last_error": self.last_error,
            "last_verification": last.as_dict() if last else None,
            "gpu_memory": memory.as_dict() if memory else None,
            "transitions": list(self.history),
            "drift_events": list(self.drift_events),
            "upstream": self._client.base_url,
            "policies": {
                "on_sleeping": self._settings.on_sleeping,
                "idle_sleep_after_s": self._settings.idle_sleep_after_s,
                "idle_sleep_level": self._settings.idle_sleep_level,
                "drain_before_sleep_s": self._settings.drain_before_sleep_s,
            },
        }

    # ----- submitting calls
    async def submit(self, call: LifecycleCall) -> OpResult:
        """Run `call` serialized with every other lifecycle call; raises LifeguardError on failure."""
        joined = self._pending.get(call.key)
        if joined is not None:
            started = time.monotonic()
            try:
                return await asyncio.shield(joined)
            finally:
                self._metrics.operation_finished(call.op, "joined", time.monotonic() - started)
        if call.op == "update_weights" and self.weight_update_active:
            # Inside an open session the trainer's NCCL send runs concurrently: never queue this.
            return await self._timed(call, self._forward_in_session(call))
        future: asyncio.Future[OpResult] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_mark_retrieved)
        self._pending[call.key] = future
        spawn(self._serialized(call, future), name=f"lifecycle:{call.op}")
        return await asyncio.shield(future)

    async def _serialized(self, call: LifecycleCall, future: asyncio.Future[OpResult]) -> None:
        try:
            result = await self._timed(call, self._locked(call))
        except LifeguardError as exc:
            future.set_exception(exc)
        except Exception as exc:  # a bug must still end the call cleanly, never as a hang or a 500
            log.exception("lifecycle operation %s crashed", call.op)
            future.set_exception(LifeguardError(f"internal error while running {call.op}: {exc!r}"))
        else:
            future.set_result(result)
        finally:
            self._pending.pop(call.key, None)

    async def _locked(self, call: LifecycleCall) -> OpResult:
        try:
            async with asyncio.timeout(self._settings.lifecycle_queue_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            raise LifecycleBusy(
                f"another lifecycle operation held the engine for {self._settings.lifecycle_queue_timeout_s:g} s",
            ) from None
        try:
            return await self._execute(call)
        finally:
            self._lock.release()

    async def _timed(self, call: LifecycleCall, work: Awaitable[OpResult]) -> OpResult:
        started = time.monotonic()
        before = self.state
        outcome = "ok"
        upstream_status: int | None = None
        try:
            result = await work
            outcome = result.outcome
            return result
        except LifeguardError as exc:
            outcome = _OUTCOME_OF.get(exc.reason, "refused" if exc.status in (409, 503) else "upstream_error")
            if isinstance(exc, UpstreamError):
                outcome = "upstream_error"
                upstream_status = getattr(exc, "upstream_status", None)
            if isinstance(exc, (UpstreamError, VerificationFailed)):
                self.last_error = {"reason": exc.reason, "message": exc.message, "at": time.time()}
            raise
        finally:
            seconds = time.monotonic() - started
            self._metrics.operation_finished(call.op, outcome, seconds)
            last = self._verifier.last
            log.info(
                "lifecycle %s: %s",
                call.op,
                outcome,
                extra={
                    "event": "lifecycle_op",
                    "operation": call.op,
                    "query": "&".join(f"{k}={v}" for k, v in call.query),
                    "from_state": before.value,
                    "to_state": self.state.value,
                    "duration_s": round(seconds, 4),
                    "outcome": outcome,
                    "upstream_status": upstream_status,
                    "verification": _summary(last) if last and last.at >= time.time() - seconds - 0.001 else None,
                },
            )

    async def _execute(self, call: LifecycleCall) -> OpResult:
        decision = judge(call, self.view())
        if isinstance(decision, Refuse):
            raise decision.error
        if isinstance(decision, Noop):
            return _json_result(decision.body, "noop", **{"X-Lifeguard-Noop": "true"})
        if isinstance(decision, Record):
            self.user_pause = call.mode or "abort"
            return _json_result(decision.body, "ok", **{"X-Lifeguard-Deferred": "pause applied on wake"})
        operation: Callable[[LifecycleCall], Awaitable[OpResult]] = getattr(self, f"_do_{call.op}")
        return await operation(call)

    # ----- the operations (called under the lock, from a settled state)
    async def _do_sleep(self, call: LifecycleCall) -> OpResult:
        level = call.level if call.level is not None else 1
        before = await self._verifier.read_memory()
        if self.state is State.RUNNING:
            self._verifier.note_awake(before)
        prev = self.state
        self._fire("begin_sleep")
        headers: dict[str, str] = {}
        if self._settings.drain_before_sleep_s > 0 and call.mode == "abort" and self._gate.inflight:
            self._metrics.policy_action("drain_before_sleep")
            drained = await self._gate.wait_idle(self._settings.drain_before_sleep_s)
            headers["X-Lifeguard-Drained"] = "complete" if drained else f"timeout; {self._gate.inflight} aborted"
        reply = await self._upstream(call, "/sleep", hint=prev)
        expect = Expectation(sleeping=True, paused=True, memory="freed" if level >= 1 else None)
        verdict = await self._verifier.verify(expect, memory_before=before)
        failed = verdict.failed
        if failed is not None and not (
            failed.name == "memory" and verdict.observation and verdict.observation.sleeping
        ):
            self._caught_lie(call, verdict, hint=prev)
        self.sleep_level = level
        self.asleep_tags = asleep_tags_for(level)
        if prev is State.PAUSED and self.user_pause is None:
            self.user_pause = "abort"
        if level == 2:
            self.weights_stale = "discarded"
            self._verifier.forget_golden()
        self._fire("settle_sleeping")
        if failed is not None:  # asleep by the flags, but nothing was freed: the engine is where it says
            self._caught_lie(call, verdict, hint=State.SLEEPING, adopt=False)
        return _reply_result(reply, verdict, headers)

    async def _do_wake_up(self, call: LifecycleCall) -> OpResult:
        view = self.view()
        targets = wake_targets(call, view)
        remaining = frozenset() if view.asleep_tags == {"scheduling"} else view.asleep_tags - targets
        full = not remaining
        if call.tags is None or view.asleep_tags == {"scheduling"}:
            sent = call
        else:  # only what is still asleep: vLLM's repeat of an awake tag is a silent no-op at best
            sent = LifecycleCall("wake_up", tuple(("tags", t) for t in sorted(targets)), tags=tuple(sorted(targets)))
        before = await self._verifier.read_memory()
        self._fire("begin_wake")
        reply = await self._upstream(sent, "/wake_up", hint=State.SLEEPING)
        memory = None
        if view.sleep_level != 0:
            memory = "restored" if full else ("weights_restored" if "weights" in targets else None)
        canary = full and self.weights_stale != "discarded"
        verdict = await self._verifier.verify(
            Expectation(sleeping=not full, paused=None if not full else False, memory=memory, canary=canary),
            memory_before=before,
        )
        if verdict.failed is not None:
            self._caught_lie(call, verdict, hint=State.SLEEPING)
        self.asleep_tags = remaining
        if not full:
            self._fire("settle_sleeping")
            return _reply_result(reply, verdict)
        self.sleep_level = None
        if verdict.memory is not None:
            self._verifier.note_awake(verdict.memory)
        if self.user_pause is not None:
            # vLLM's /wake_up resumes a paused scheduler; the user's pause must survive a sleep/wake cycle.
            await self._upstream(
                LifecycleCall("pause", (("mode", self.user_pause),), mode=self.user_pause), "/pause", hint=State.PAUSED
            )
            repaused = await self._verifier.verify(Expectation(sleeping=True, paused=True), memory_before=None)
            if repaused.failed is not None:
                self._caught_lie(call, repaused, hint=State.PAUSED)
            self._fire("settle_paused")
            return _reply_result(reply, verdict, {"X-Lifeguard-Pause-Kept": self.user_pause})
        self._fire("settle_running")
        return _reply_result(reply, verdict)

    async def _do_pause(self, call: LifecycleCall) -> OpResult:
        self._fire("begin_pause")
        reply = await self._upstream(call, "/pause", hint=State.RUNNING)
        verdict = await self._verifier.verify(Expectation(sleeping=True, paused=True), memory_before=None)
        if verdict.failed is not None:
            self._caught_lie(call, verdict, hint=State.RUNNING)
        self.user_pause = call.mode or "abort"
        self._fire("settle_paused")
        return _reply_result(reply, verdict)

    async def _do_resume(self, call: LifecycleCall) -> OpResult:
        self._fire("begin_resume")
        reply = await self._upstream(call, "/resume", hint=State.PAUSED)
        verdict = await self._verifier.verify(Expectation(sleeping=False, paused=False), memory_before=None)
        if verdict.failed is not None:
            self._caught_lie(call, verdict, hint=State.PAUSED)
        self.user_pause = None
        self._fire("settle_running")
        return _reply_result(reply, verdict)

    async def _do_start_weight_update(self, call: LifecycleCall) -> OpResult:
        prev = self.state
        self._fire("begin_weight_update")
        try:
            reply = await self._upstream(call, "/start_weight_update", hint=prev)
        except UpstreamBadStatus:
            self._settle(prev)
            raise
        self.weight_update_active = True
        self._return_state = prev
        return _reply_result(reply, None)

    async def _do_update_weights(self, call: LifecycleCall) -> OpResult:
        prev = self.state  # no session open: this call is a session of its own
        self._fire("begin_weight_update")
        try:
            reply = await self._upstream(call, "/update_weights", hint=prev)
        finally:
            if self.state is State.UPDATING_WEIGHTS:
                self._settle(prev)
        self._weights_loaded()
        return _reply_result(reply, None)

    async def _do_finish_weight_update(self, call: LifecycleCall) -> OpResult:
        reply = await self._upstream(call, "/finish_weight_update", hint=State.UPDATING_WEIGHTS)
        self.weight_update_active = False
        self._weights_loaded()
        self._settle(self._return_state)
        return _reply_result(reply, None)

    async def _do_collective_rpc(self, call: LifecycleCall) -> OpResult:
        reply = await self._upstream(call, "/collective_rpc", hint=self.state)
        if call.rpc_method in self._settings.weight_reload_rpc_methods:
            self._weights_loaded()
        return _reply_result(reply, None)

    async def _forward_in_session(self, call: LifecycleCall) -> OpResult:
        if "weights" in self.asleep_tags:
            raise InvalidTransition("the weights are asleep; wake them before updating them", reason="weights_asleep")
        reply = await self._client.lifecycle(
            "POST", "/update_weights", query=call.query, body=call.body or None,
            timeout_s=self._settings.lifecycle_call_timeout_s, headers=_json_ct(call),
        )  # fmt: skip
        return _reply_result(reply, None)

    # ----- upstream calls and what their failures mean
    async def _upstream(self, call: LifecycleCall, path: str, *, hint: State) -> Reply:
        try:
            return await self._watching(
                self._client.lifecycle(
                    "POST",
                    path,
                    query=call.query,
                    body=call.body or None,
                    timeout_s=self._settings.lifecycle_call_timeout_s,
                    headers=_json_ct(call),
                )  # fmt: skip
            )
        except UpstreamError as exc:
            obs = await self._client.observe()
            self._adopt(obs, hint=hint, reason=exc)
            raise

    async def _watching(self, work: Awaitable[T]) -> T:
        """Await `work`, but give up as soon as vLLM's /health says the engine is gone: a utility call in
        flight when the engine dies is never completed by vLLM (#57853), it would hang to its deadline."""
        task = spawn(_awaited(work), name="lifecycle:upstream")
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._settings.reconcile_interval_s)
                if done:
                    return task.result()
                try:
                    alive = await self._client.health()
                except UpstreamError:
                    alive = False
                if not alive:
                    raise UpstreamUnreachable("the engine died while the lifecycle call was in flight")
        finally:
            task.cancel()

    def _caught_lie(self, call: LifecycleCall, verdict: Verdict, *, hint: State, adopt: bool = True) -> None:
        check = verdict.failed
        assert check is not None
        self._metrics.lie_caught(call.op, check.name)
        obs = verdict.observation
        if adopt:
            if check.name == "canary":
                self._set_failed("garbage", f"the engine produces garbage after {call.op}: {check.detail}")
            elif check.name == "memory" and call.op == "wake_up":
                self._set_failed("memory", f"the engine says awake but its memory is not back: {check.detail}")
            elif obs is not None:
                self._adopt(obs, hint=hint, reason=None)
        raise VerificationFailed(f"vLLM answered /{call.op} 200 but {check.name} check failed: {check.detail}",
                                 check=check.name)  # fmt: skip

    # ----- adopting what the engine really is
    def _adopt(self, obs: Observation, *, hint: State, reason: LifeguardError | None) -> None:
        if not obs.reachable or not obs.healthy:
            message = reason.message if reason else (obs.error or "/health is not 200")
            self._set_failed("unreachable", message)
            return
        if obs.sleeping is False and not obs.paused:
            self.asleep_tags, self.sleep_level, self.user_pause = frozenset(), None, None
            self._settle(State.RUNNING if hint is not State.UPDATING_WEIGHTS or not self.weight_update_active else hint)
        elif hint in (State.PAUSED, State.RUNNING, State.PAUSING, State.RESUMING):
            self.user_pause = self.user_pause or "abort"
            self._settle(State.PAUSED)
        elif hint is State.UPDATING_WEIGHTS:
            self._settle(State.UPDATING_WEIGHTS)
        else:
            if not self.asleep_tags:
                self.asleep_tags = asleep_tags_for(self.sleep_level if self.sleep_level is not None else 1)
                self.sleep_level = self.sleep_level if self.sleep_level is not None else 1
            self._settle(State.SLEEPING)

    def _settle(self, state: State) -> None:
        trigger = {
            State.RUNNING: "settle_running",
            State.PAUSED: "settle_paused",
            State.SLEEPING: "settle_sleeping",
            State.UPDATING_WEIGHTS: "settle_updating",
        }[state]
        if self.state is State.FAILED:
            self._fire("engine_back")
        if self.state is not state:
            self._fire(trigger)

    def _set_failed(self, kind: str, message: str) -> None:
        self.failure_kind = kind
        self.last_error = {"reason": "engine_" + kind, "message": message, "at": time.time()}
        if self.state is not State.FAILED:
            self._fire("fail")

    def _weights_loaded(self) -> None:
        if self.weights_stale is not None:
            self.weights_stale = None
            self._metrics.weights_stale(False)
            self._refresh_gate()
        self._verifier.forget_golden()

    # ----- the reconcile loop's entry point (reconcile.py drives it)
    async def reconcile(self) -> None:
        """Compare vLLM's flags with ours while nothing is in flight; adopt what is observed."""
        if self._lock.locked():
            return
        async with self._lock:
            obs = await self._client.observe()
            memory = await self._verifier.read_memory()
            self._reconcile_with(obs)
            if self.state is State.RUNNING and not self.weight_update_active:
                self._verifier.note_awake(memory)

    def _reconcile_with(self, obs: Observation) -> None:
        state = self.state
        if not obs.reachable or not obs.healthy:
            if state is not State.FAILED:
                self._set_failed("unreachable", obs.error or "/health is not 200")
            else:
                self.failure_kind = "unreachable"
            return
        if state is State.FAILED:
            if self.failure_kind != "unreachable":
                return  # healthy but broken (garbage, memory): only a restart brings it back
            self._fire("engine_back")
            if self._ever_running:
                self._restarted()
            state = State.STARTING
        if state is State.STARTING:
            self._adopt(obs, hint=State.STARTING if obs.paused else State.RUNNING, reason=None)
            return
        if state is State.UPDATING_WEIGHTS:
            return
        expected = (False, False) if state is State.RUNNING else (True, True)
        seen = (obs.sleeping, obs.paused if obs.paused is not None else obs.sleeping)
        if seen != expected:
            before = self.state.value
            self._adopt(obs, hint=state, reason=None)
            event = {"at": time.time(), "before": before, "after": self.state.value, "observed": seen}
            self.drift_events.append(event)
            self._metrics.drift()
            log.warning("drift: vLLM's flags disagree with our state", extra={"event": "drift", **event})

    def _restarted(self) -> None:
        """A restarted vLLM holds its initial checkpoint, not the trained weights."""
        self._metrics.engine_restart()
        self.weights_stale = "restarted"
        self._metrics.weights_stale(True)
        self.weight_update_active = False
        self.user_pause = None
        self.asleep_tags, self.sleep_level = frozenset(), None
        self._verifier.forget_golden()
        log.warning("engine restarted; weights marked stale", extra={"event": "engine_restart"})

    # ----- policies that start lifecycle calls themselves
    def wake_on_request(self) -> None:
        """Policy on_sleeping=wake: one wake for however many requests arrive while asleep."""
        if self.state is not State.SLEEPING or self.weights_stale == "discarded":
            return
        self._metrics.policy_action("wake_on_request")
        spawn(self._quietly(LifecycleCall("wake_up")), name="policy:wake_on_request")

    def maybe_idle_sleep(self, now: float) -> None:
        after = self._settings.idle_sleep_after_s
        if after is None or self.state is not State.RUNNING or self.busy:
            return
        if self._gate.inflight or self._gate.held or now - self._gate.last_activity < after:
            return
        level = self._settings.idle_sleep_level
        self._metrics.policy_action("idle_sleep")
        spawn(
            self._quietly(
                LifecycleCall("sleep", (("level", str(level)), ("mode", "abort")), level=level, mode="abort")
            ),
            name="policy:idle_sleep",
        )

    async def _quietly(self, call: LifecycleCall) -> None:
        try:
            await self.submit(call)
        except LifeguardError as exc:
            log.warning("policy %s failed: %s", call.op, exc.message, extra={"event": "policy", "reason": exc.reason})

    def close(self) -> None:
        self._gate.close()

    # ----- state changes
    def _fire(self, trigger: str) -> None:
        self.lifecycle.fire(trigger)

    def _on_state_change(self, src: State, dst: State) -> None:
        if src is dst:
            return
        self.since = time.time()
        if dst is State.RUNNING:
            self._ever_running = True
        if dst is not State.FAILED and src is State.FAILED:
            self.failure_kind = None
        self.history.append({"from": src.value, "to": dst.value, "at": self.since})
        self._metrics.state_changed(src.value, dst.value)
        log.info("state %s -> %s", src.value, dst.value,
                 extra={"event": "state_change", "from_state": src.value, "to_state": dst.value})  # fmt: skip
        self._refresh_gate()

    def _refresh_gate(self) -> None:
        decision = admission(
            self.view(),
            on_sleeping=self._settings.on_sleeping,
            hold_while_restarted=self._settings.hold_while_weights_stale,
        )
        self._gate.set_admission(decision, sleeping=self.state is State.SLEEPING)


def _reply_result(reply: Reply, verdict: Verdict | None, headers: dict[str, str] | None = None) -> OpResult:
    extra = dict(headers or {})
    if verdict is not None:
        extra["X-Lifeguard-Verified"] = ",".join(f"{c.name}={c.result}" for c in verdict.checks)
    return OpResult(reply.status, reply.body, reply.content_type, extra)


def _json_ct(call: LifecycleCall) -> dict[str, str] | None:
    return {"Content-Type": "application/json"} if call.body else None


def _summary(verdict: Verdict) -> str:
    return ",".join(f"{c.name}={c.result}" for c in verdict.checks)


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _awaited(work: Awaitable[T]) -> T:
    return await work
