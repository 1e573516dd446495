"""`LifecycleCoordinator`: the one owner of an engine's lifecycle state; it alone decides and acts.

A state read that gates a mutation happens in here, under the one lock; everyone else reads `snapshot()`. Each
lifecycle call runs as a coordinator-owned task: wait its turn (FIFO, with a deadline), judge it (rules.judge),
begin (the gate holds), call vLLM watching for its death, verify, settle or adopt what the engine really is.
An identical pending call is joined, not repeated: vLLM's own repeats are not harmless. docs/design.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from ..config import Settings
from ..errors import LifecycleBusy, LifeguardError, UpstreamError, UpstreamRejected, VerificationFailed
from ..gpu.readers import GpuReading
from ..observe.metrics import EngineMetrics
from ..tasks import Tasks
from ..upstream.observation import LateReads, Observation
from ..upstream.refusals import Refusal
from ..upstream.vllm_client import VllmClient
from .checkpoint_operations import CheckpointOperations
from .engine_calls import EngineCalls
from .fault_tolerance import FaultToleranceWatch
from .gate import RequestGate
from .inflight import InFlightRequests
from .offload_tier import RESET_EXTERNAL, keeps_tier
from .outcome import Outcome, answered_by_us, from_vllm
from .parsed_calls import LifecycleCall
from .persisted_facts import PersistedFacts
from .prefix_cache import HEADER, RESET_PATH, reset_result
from .record import EngineRecord, FailureKind
from .rules import (
    CHECKPOINT_OPERATIONS,
    WEIGHTLESS,
    Admission,
    Defer,
    Noop,
    Refuse,
    SessionTarget,
    Staleness,
    admission,
    control_refusal,
    judge,
    unavailable,
)
from .sleep_operations import SleepOperations
from .stall import StallWatch
from .state_file import StateFile
from .states import State
from .verifier import Verifier
from .weight_checksums import WeightChecksums
from .weight_updates import WEIGHT_OPERATIONS, WeightUpdates
from .weight_version import WeightVersions
from .worker_rpcs import RpcKind

log = logging.getLogger("lifeguard.lifecycle")
T = TypeVar("T")

Submit = Callable[[LifecycleCall], Awaitable[Outcome]]


class SubmitGuard(Protocol):
    """What stands before an engine's coordinator when several engines share GPUs (proxy/sharing/arbiter.py): every
    lifecycle call goes through `run`, which may wait for a GPU, make room, and then `submit` it."""

    @property
    def reloads_discarded_weights(self) -> bool: ...

    async def run(self, call: LifecycleCall, submit: Submit) -> Outcome: ...


class LifecycleCoordinator:
    def __init__(
        self,
        settings: Settings,
        client: VllmClient,
        verifier: Verifier,
        gate: RequestGate,
        metrics: EngineMetrics,
        tasks: Tasks | None = None,
        inflight: InFlightRequests | None = None,
    ) -> None:
        self._settings = settings
        self.tasks = tasks or Tasks()
        self.inflight = inflight if inflight is not None else InFlightRequests()
        self._state_file = StateFile(settings.state_file)
        self._client = client
        self._verifier = verifier
        self._gate = gate
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._late_rounds = LateReads(settings.late_rounds_before_failed)
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...], bytes], asyncio.Future[Outcome]] = {}
        self.checksums = WeightChecksums(settings, client, metrics)
        self.versions = WeightVersions(metrics.versions, self._remember)
        self.record = EngineRecord(
            metrics,
            self._refresh_gate,
            on_weights_changed=self._weights_changed,
            on_weights_discarded=self.end_forwarded_requests,
            upstream=settings.upstream_shown or "vLLM",
            on_new_weights=self.versions.advanced,
        )
        self._calls = EngineCalls(settings, client, verifier, self.record, self.tasks)
        self._weights = WeightUpdates(
            settings, self.record, self._calls, self._lock, self.checksums, self._write_ahead, self.versions, verifier
        )
        self._sleep = SleepOperations(
            settings,
            self.record,
            self._calls,
            verifier,
            gate,
            metrics,
            self._write_ahead,
            self.checksums,
            self.end_forwarded_requests,
        )
        self._checkpoint = CheckpointOperations(
            settings, client, self.record, self._calls, verifier, self.checksums, metrics, self._sleep._lie
        )
        self._fault_tolerance = FaultToleranceWatch(client, self.record)
        self._stall = StallWatch(settings.stall_after_s, self.inflight, self.record, metrics)
        self._weight_rpc_methods = frozenset(settings.weight_reload_rpc_methods + settings.weight_update_rpc_methods)
        self.guard: SubmitGuard | None = None
        previous = self._state_file.load()
        if previous is not None:  # a restarted proxy: what vLLM cannot tell us, as the last one left it
            log.warning("state file read: %s", previous, extra={"event": "state_file_read"})
            self.versions.remember(previous.weight_version, previous.weights_partial_after)
            if previous.user_pause is not None:
                self.record.paused_by_user(previous.user_pause)
            if previous.weights_stale is not None:
                self.record.mark_stale(previous.weights_stale)
            if previous.prefix_partition is not None:
                self.record.remembered_partition(previous.prefix_partition)
            self.record.offload_tier_kept = previous.offload_tier_kept
            if previous.weight_update_session is not None:
                self.record.remembered_session(
                    SessionTarget(previous.weight_update_session), State(previous.session_returns_to or "RUNNING")
                )
            if previous.weights_before_sleep is not None:
                self.checksums.remember_before_sleep(previous.weights_before_sleep)
            if previous.asleep_tags:
                self.record.remembered_asleep(
                    frozenset(previous.asleep_tags),
                    previous.sleep_level,
                    unconfirmed=previous.sleep_unconfirmed,
                    outside_vllm=previous.asleep_outside_vllm,
                )
        if self.record.prefix_partition is None:
            # Blocks in vLLM's prefix cache may come from weights this proxy never saw loaded (a change a killed
            # proxy's call made, or one before it started): salted until the first reset, on the first idle round.
            self.record.weights_committed(
                "the proxy started: cached blocks may be of weights it did not see", new_weights=False
            )
        self._refresh_gate()

    @property
    def state(self) -> State:
        return self.record.state

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def client(self) -> VllmClient:
        return self._client

    @property
    def verifier(self) -> Verifier:
        return self._verifier

    @property
    def weights_stale(self) -> bool:
        return self.record.weights_stale is not None

    def snapshot(self) -> dict[str, Any]:
        """The public state (`GET /lifeguard/state`); advisory for anyone but the coordinator."""
        last = self._verifier.last
        memory = self._verifier.last_memory
        return {
            **self.record.snapshot(),
            "held_requests": self._gate.held,
            "inflight_requests": self._gate.inflight,
            "lifecycle_busy": self.busy,
            "last_verification": last.as_dict() if last else None,
            "gpu_memory": memory.as_dict() if memory else None,
            # LoRA adapters seen while healthy (and whether their canary answer is recorded), and those lost in a wake
            "lora_adapters": {
                name: {"root": mark.root, "canary_recorded": mark.golden is not None}
                for name, mark in sorted(self._verifier.adapters.items())
            },
            "lost_lora_adapters": sorted(self._verifier.lost_adapters),
            "weight_checksums": self.checksums.snapshot(),
            "weight_version": self.versions.snapshot(),
            "upstream": self._settings.upstream_shown,
            "policies": {
                "on_sleeping": self._settings.on_sleeping,
                "idle_sleep_after_s": self._settings.idle_sleep_after_s,
                "idle_sleep_level": self._settings.idle_sleep_level,
                "drain_before_sleep_s": self._settings.drain_before_sleep_s,
                "stall_after_s": self._settings.stall_after_s,
            },
        }

    # ----- submitting calls
    async def submit(self, call: LifecycleCall) -> Outcome:
        """Run `call` serialized with every other lifecycle call, through the guard when there is one (several
        engines on shared GPUs); raises LifeguardError on failure."""
        if self.guard is not None and not self._in_open_session(call):
            return await self.guard.run(call, self.submit_unguarded)
        return await self.submit_unguarded(call)

    def _in_open_session(self, call: LifecycleCall) -> bool:
        return call.op == "update_weights" and self.record.weight_update_active and self.state is State.UPDATING_WEIGHTS

    async def submit_unguarded(self, call: LifecycleCall) -> Outcome:
        """`submit` without the guard: for the guard itself."""
        joined = self._pending.get(call.key)
        if joined is not None:
            started = time.monotonic()
            try:
                return await asyncio.shield(joined)
            finally:
                self._metrics.operation_finished(call.op, "joined", time.monotonic() - started)
        if self._in_open_session(call):
            # Inside an open session the trainer's NCCL send runs concurrently: never queue this.
            return await self._timed(call, self._in_session(call))
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_mark_retrieved)
        self._pending[call.key] = future
        self.tasks.spawn(self._serialized(call, future), name=f"lifecycle:{call.op}")
        return await asyncio.shield(future)

    async def _serialized(self, call: LifecycleCall, future: asyncio.Future[Outcome]) -> None:
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

    async def _acquire(self) -> None:
        """Wait for the lock, FIFO, at most lifecycle_queue_timeout_s; then 409 lifecycle_busy."""
        try:
            async with asyncio.timeout(self._settings.lifecycle_queue_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            raise LifecycleBusy(
                f"another lifecycle operation held the engine for {self._settings.lifecycle_queue_timeout_s:g} s",
            ) from None

    async def _locked(self, call: LifecycleCall) -> Outcome:
        await self._acquire()
        try:
            partition = self.record.prefix_partition
            outcome = await self._execute(call)
            if keeps_tier(call):
                self.record.offload_tier_kept = True
            if self.record.prefix_partition is not partition or call.op == "resume":
                await self._clear_prefix_cache()
            return outcome
        finally:
            self._remember()
            self._lock.release()

    async def _timed(self, call: LifecycleCall, work: Awaitable[Outcome]) -> Outcome:
        started = time.monotonic()
        before = self.state
        outcome = "ok"
        upstream_status: int | None = None
        verification: str | None = None
        lie: VerificationFailed | None = None
        try:
            result = await work
            outcome = result.label
            verification = result.verdict.summary() if result.verdict else None
            return result
        except LifeguardError as exc:
            outcome = _outcome_of(exc)
            upstream_status = getattr(exc, "upstream_status", None)
            if isinstance(exc, VerificationFailed):
                verification, lie = exc.verification, exc
            if isinstance(exc, (UpstreamError, VerificationFailed)):
                self.record.error(exc.reason, exc.message)
            raise
        finally:
            seconds = time.monotonic() - started
            self._metrics.operation_finished(call.op, outcome, seconds)
            # A caught "200 lie" is what an operator must see among the successes: a WARNING naming its check.
            log.log(
                logging.WARNING if lie else logging.INFO,
                "lifecycle %s: %s",
                call.op,
                f'a "200 lie" caught by the {lie.check} check: {lie.message}' if lie else outcome,
                extra={
                    "event": "lifecycle_op",
                    "operation": call.op,
                    "query": "&".join(f"{k}={v}" for k, v in call.query),
                    "from_state": before.value,
                    "to_state": self.state.value,
                    "duration_s": round(seconds, 4),
                    "outcome": outcome,
                    "upstream_status": upstream_status,
                    "verification": verification,
                    "lie_check": lie.check if lie else None,
                },
            )

    async def _execute(self, call: LifecycleCall) -> Outcome:
        decision = judge(call, self.record.view(), self._weight_rpc_methods)
        if isinstance(decision, Refuse):
            raise decision.error
        if isinstance(decision, Noop):
            return answered_by_us(decision.body, noop=True)
        if isinstance(decision, Defer):
            self.record.paused_by_user(call.mode or "abort")
            return answered_by_us(decision.body, deferred=True)
        if call.rpc_kind is RpcKind.SLEEP_FOR_SYNC or (
            call.rpc_kind is RpcKind.WAKE_FOR_SYNC and self.record.asleep_outside_vllm
        ):
            return await self._sleep.run_worker_rpc(call)
        if call.op in WEIGHT_OPERATIONS:
            return from_vllm(await self._weights.run(call), None)
        if call.op in CHECKPOINT_OPERATIONS:
            return await self._checkpoint.run(call)
        return await self._sleep.run(call)

    async def exclusive(
        self, work: Callable[[], Awaitable[T]], *, adapters_may_change: bool = True, zeroes_weights: bool = False
    ) -> T:
        """Run a control call that touches weights or memory (routes.RouteKind.SERIALIZED) after any lifecycle
        transition in progress, never during one; it is not held by a sleep or a pause. `adapters_may_change`: the
        call may load or unload a LoRA adapter (the forwarded serialized routes: their usual business), so what the
        LoRA check recorded no longer holds. `zeroes_weights`: the call sets every weight to zero (/weight_checker
        reset): the weights are marked so before it is sent, and stay so until weights are loaded again."""
        if (refusal := control_refusal(self.record.view())) is not None:
            raise refusal
        await self._acquire()
        try:
            if (refusal := control_refusal(self.record.view())) is not None:
                raise refusal
            if zeroes_weights:
                self.record.weights_reset()
            partition = self.record.prefix_partition
            result = await self._watching_elastic_ep(work())
            if self.record.prefix_partition is not partition:
                await self._clear_prefix_cache()
            return result
        finally:
            if adapters_may_change:
                self._verifier.forget_adapters()
            self._lock.release()

    async def _watching_elastic_ep(self, work: Awaitable[T]) -> T:
        """Run `work` (a serialized control call, under the lock); while it runs past a reconcile interval, look at
        vLLM each interval, so a /scale_elastic_ep shows as SCALING and holds inference while vLLM's gate is up
        instead of letting vLLM's 503 through; once it ends, adopt what vLLM then is."""
        task = self.tasks.spawn(_awaited(work), name="control:serialized")
        watched = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._settings.reconcile_interval_s)
                if done:
                    break
                watched = True
                obs = await self._client.observe()
                if obs.elastic is not None:
                    self.record.reconcile_with(obs)
        finally:
            if not task.done():
                task.cancel()
        if watched or self.state is State.SCALING:
            obs = await self._client.observe()
            memory = await self._verifier.read_memory()
            self.record.reconcile_with(obs, memory_freed=self._verifier.memory_freed(memory))
        return task.result()

    async def _in_session(self, call: LifecycleCall) -> Outcome:
        return from_vllm(await self._weights.in_session(call), None)

    # ----- the reconcile loop's entry point (reconcile.py drives it)
    async def reconcile(self) -> None:
        """Compare vLLM's flags with ours while nothing is in flight; adopt what is observed."""
        await self._fault_tolerance.look()
        if self._lock.locked():
            return
        async with self._lock:
            obs = await self._client.observe()
            if self._answered_late(obs):
                return
            memory = await self._verifier.read_memory()
            if await self._healed(obs, memory):
                return
            if self._woken_unseen(obs) and await self.checksums.unseen_wake_mismatched():
                self.record.weights_mismatched()
            self.record.reconcile_with(obs, memory_freed=self._verifier.memory_freed(memory))
            if obs.reachable and obs.healthy:
                self.checksums.engine_answers()
            if self.state is State.RUNNING and not self.record.weight_update_active:
                self._verifier.note_awake(memory)
                if self.record.weights_stale is None:
                    # On an idle engine only: under the lock, behind a 12,000-token stream on real vLLM the canary
                    # took 17 s, and a trainer's /pause waited for it. The first wake's canary records it otherwise.
                    if self._gate.inflight == 0:
                        await self._verifier.record_golden()
                        await self._clear_prefix_cache()
                    await self._verifier.record_adapters()
                if self.record.weights_stale in (None, Staleness.RESTARTED) and self._gate.inflight == 0:
                    if self.checksums.checkpoint_due:
                        await self.checksums.take_checkpoint()

    def look_for_stall(self) -> None:
        """The stall watch's round (reconcile.py's `stall_loop`): it sends nothing, so no stall can hold it."""
        self._stall.look()

    def _woken_unseen(self, obs: Observation) -> bool:
        """vLLM is awake and running where the record holds its weights asleep: a wake no proxy verified (one a proxy
        restart cut, or one sent to vLLM directly). Checked before it is adopted and inference let go."""
        awake = obs.reachable and obs.healthy and obs.elastic is None and obs.sleeping is False
        return awake and "weights" in self.record.asleep_tags and self.state in (State.STARTING, State.SLEEPING)

    async def _clear_prefix_cache(self) -> None:
        """Under the lock, once weights changed: reset vLLM's prefix cache, so that requests need no salt again. It
        fails while requests hold blocks (kept by a pause): the reconcile loop tries again once none is in flight."""
        if self.record.prefix_partition is None or self.state in (State.STARTING, State.FAILED):
            return
        try:
            reply = await self._client.call("POST", RESET_PATH, query=[RESET_EXTERNAL])  # the offload tier too
        except UpstreamError as exc:
            log.warning("the prefix cache could not be reset: %s", exc.message, extra={"event": "prefix_reset_failed"})
            self._metrics.prefix_reset("proxy", "unknown")
            return
        result = reset_result(reply.status, reply.body)
        if result:
            self.record.offload_tier_kept = False  # before the partition's end, which saves the facts
        self._reset_answered("proxy", result)

    def client_reset_answered(self, status: int, body: bytes, *, tier_kept: bool = False) -> bytes:
        """A client's /reset_prefix_cache answered `status`, `body`: what it tells about old-weight blocks, and the
        header line its answer carries (vLLM's 200 `{"success": false}` would otherwise read as done). `tier_kept`: it
        said `reset_external=false`, so a KV connector's offload tier still holds what the old weights computed."""
        result = reset_result(status, body)
        if result and tier_kept and self.record.prefix_partition is not None:
            log.warning(
                "a client's prefix-cache reset kept the KV connector's offload tier (reset_external=false), which may "
                "hold blocks of the old weights: requests stay salted until a reset empties both tiers",
                extra={"event": "prefix_reset_tier_kept"},
            )
            self._metrics.prefix_reset("client", "not_cleared")
            return HEADER + b": partitioned"
        self._reset_answered("client", result)
        if result is False and self.record.prefix_partition is not None:
            log.warning(
                "vLLM could not reset its prefix cache (requests still hold blocks): requests admitted since the "
                "weight change stay salted until a reset succeeds",
                extra={"event": "prefix_reset_not_cleared"},
            )
        return HEADER + (b": partitioned" if self.record.prefix_partition is not None else b": clean")

    def adapter_reload_answered(self, adapter: str) -> Callable[[int, bytes], None]:
        """The reader of a `/v1/load_lora_adapter` answer that reloads `adapter` in place: a 200 is a weight change."""

        def answered(status: int, _body: bytes) -> None:
            if status == 200:
                self.record.weights_committed(f"LoRA adapter {adapter!r} was loaded in place")

        return answered

    def _reset_answered(self, by: str, result: bool | None) -> None:
        self._metrics.prefix_reset(by, {True: "cleared", False: "not_cleared", None: "unknown"}[result])
        if result:
            self.record.prefix_cache_cleared(by)

    def _answered_late(self, obs: Observation) -> bool:
        """True for a reconcile round to pass over (upstream/observation.py `LateReads`): failing a busy engine refused
        its traffic and then took it for restarted."""
        if self.state in (State.STARTING, State.FAILED) or not self._late_rounds.pass_over(obs):
            return False
        limit = self._late_rounds.limit
        self.record.error("engine_late", f"{obs.error}; FAILED if {limit} rounds in a row go unanswered")
        return True

    async def engine_refused(self, refusal: Refusal) -> State:
        """The data plane forwarded an inference request and vLLM refused it in a way that says something about the
        engine (upstream/refusals.py): its own pause (vLLM >= 0.33's `engine_paused`), or its elastic-EP gate. Read vLLM
        now, under the lock (after any lifecycle call in progress), and adopt what it is: a pause the proxy did not
        make becomes PAUSED (a drift event, released by /resume like any pause; a /resume sent to vLLM directly is
        adopted the same way), the gate SCALING or FAILED. Returns the state after; the caller then hands the
        request to the gate again, which holds it, refuses it with the reason, or forwards it (vLLM was not paused
        any more: the pause ended meanwhile, or it was another retryable refusal). Never raises for a busy lock: the
        state is then what the call in progress leaves."""
        try:
            await self._acquire()
        except LifecycleBusy:
            return self.state
        try:
            obs = await self._client.observe()
            memory = await self._verifier.read_memory()
            self.record.reconcile_with(obs, memory_freed=self._verifier.memory_freed(memory), cause=refusal.kind)
            return self.state
        finally:
            self._lock.release()

    async def _healed(self, obs: Observation, memory: GpuReading) -> bool:
        """FAILED on a healthy, awake engine (garbage, memory or an adapter lost): re-run the check that failed."""
        failure = self.record.failure_kind
        if self.state is not State.FAILED or failure not in (FailureKind.GARBAGE, FailureKind.MEMORY, FailureKind.LORA):
            return False
        if obs.elastic is not None or not (obs.reachable and obs.healthy and obs.sleeping is False and not obs.paused):
            return False  # asleep or paused: nothing to re-check (a canary would be held); restart or reconcile
        canary = self.record.weights_stale not in WEIGHTLESS
        if failure is FailureKind.LORA:
            check = await self._verifier.recheck_adapters()
        else:
            check = await self._verifier.recheck(failure, memory, canary=canary)
        if check.result != "pass":
            return False
        self.record.healed(obs)
        self._verifier.note_awake(memory)
        return True

    def _weights_changed(self) -> None:
        """The engine's weights are not the ones they were: what was recorded from the old ones no longer holds."""
        self._verifier.forget_golden()
        self.checksums.weights_changed()

    def swap_out(self, for_engine: str | None) -> None:
        """Hold new requests while this engine is drained to be put to sleep for `for_engine`'s turn (the
        arbiter's swap); None: admit them again (the swap is over, or did not happen)."""
        self.record.swap_out(for_engine)

    def end_forwarded_requests(self, why: str) -> None:
        """End every request forwarded and not answered yet (503 `aborted_by_sleep`), for any call after which
        what vLLM queued would not run as it was sent; their connections to vLLM are closed on return, so the
        next call under the lock (a wake) finds them gone."""
        self.inflight.abort_all(why)

    def close(self) -> None:
        self._gate.close()

    def _refresh_gate(self) -> None:
        partition = self.record.prefix_partition
        self._verifier.cache_salt = partition.salt if partition is not None else None
        view = self.record.view()
        decision = admission(
            view, on_sleeping=self._settings.on_sleeping, hold_while_restarted=self._settings.hold_while_weights_stale
        )
        refusal = unavailable(view) if decision is Admission.REJECT_FAILED else None
        self._gate.set_admission(decision, sleeping=self.state is State.SLEEPING, refusal=refusal)
        if refusal is not None and view.failure is FailureKind.RETIRED and self._gate.held:
            self._gate.refuse_held(refusal)  # nothing will be served here again: waiting out the hold changes nothing
        self._remember()

    def _remember(self) -> None:
        if self._state_file.enabled:
            self._state_file.save(self._facts())

    def _write_ahead(self, **changes: Any) -> None:
        """Save the facts as they will be if the call about to be sent takes: a proxy killed while it runs must not
        believe what it believed before it (a level-2 sleep discards the weights, a start opens a session)."""
        if self._state_file.enabled:
            self._state_file.save(replace(self._facts(), **changes))

    def _facts(self) -> PersistedFacts:
        return replace(
            self.record.persisted_facts(),
            weights_before_sleep=self.checksums.before_sleep_digest,
            weight_version=self.versions.current,
            weights_partial_after=self.versions.partial_after,
        )


def _outcome_of(error: LifeguardError) -> str:
    if isinstance(error, UpstreamRejected):
        return "invalid"
    if isinstance(error, LifecycleBusy):
        return "busy"
    if isinstance(error, VerificationFailed):
        return "verification_failed"
    if isinstance(error, UpstreamError):
        return "upstream_error"
    return "refused"


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
