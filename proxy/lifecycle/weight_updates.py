"""`WeightUpdates`: the weight-update operations (the session phases and `/collective_rpc`).

The coordinator runs them under its lock, except `/update_weights` inside an open session: forwarded at once,
because the trainer's NCCL send runs beside it. `/finish_weight_update` reloads the model only when the session
wrote it (not a drafter's session, not a LoRA round), and settles what vLLM's flags then say. A session is written to
the state file ahead of its start, and `reset_weights` is marked before it is sent: vLLM shows neither. Reloads and
sessions are checked by the weights' checksums (weight_checksums.py). docs/design.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from ..config import Settings
from ..errors import (
    UpstreamBadStatus,
    UpstreamError,
    VerificationFailed,
    WeightsAsleep,
    WeightsPartial,
    WeightUpdateActive,
    WeightUpdateSessionLost,
)
from ..upstream.vllm_client import Reply
from .engine_calls import EngineCalls
from .parsed_calls import LifecycleCall
from .record import EngineRecord
from .rules import START_OPERATIONS, FailureKind, SessionTarget, Staleness
from .states import State
from .verdict import CheckName, CheckResult
from .verifier import AdapterMark, Verifier, lost_detail
from .weight_checksums import RESET_RPC, WeightChecksums, reloads_checkpoint
from .weight_version import WeightVersions, json_object, label_sent, with_label
from .worker_rpcs import RpcKind

log = logging.getLogger("lifeguard.lifecycle")

# What vLLM's worker (0.32, gpu_worker.py) says when it holds no weight update session.
_NO_SESSION_MESSAGES = (
    "start_weight_update must be called before update_weights",
    "called without a matching start_weight_update",
)
# ... and to a start when it holds one already.
_SESSION_OPEN_MESSAGE = "while a weight update is already active"
WEIGHT_OPERATIONS = frozenset(
    {"start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update", "collective_rpc"}
)


class WeightUpdates:
    def __init__(
        self,
        settings: Settings,
        record: EngineRecord,
        calls: EngineCalls,
        lock: asyncio.Lock,
        checksums: WeightChecksums,
        write_ahead: Callable[..., None],
        versions: WeightVersions,
        verifier: Verifier,
    ) -> None:
        self._verifier = verifier
        self._settings = settings
        self._versions = versions
        # The open session's chunk that failed mid-way: vLLM's worker ended the session there.
        self._failed_chunk: str | None = None
        self._checksums = checksums
        self._write_ahead = write_ahead
        self._record = record
        self._calls = calls
        self._lock = lock

    async def run(self, call: LifecycleCall) -> Reply:
        """One of WEIGHT_OPERATIONS, under the coordinator's lock."""
        if call.op in START_OPERATIONS:
            return await self._start(call)
        if call.op == "update_weights":
            return await self._update(call)
        if call.op == "finish_weight_update":
            return await self._finish(call)
        return await self._collective_rpc(call)

    async def in_session(self, call: LifecycleCall, *, locked: bool = False) -> Reply:
        """`/update_weights` inside an open session; `locked`: whether we already hold the lock."""
        if "weights" in self._record.asleep_tags:
            raise WeightsAsleep("the weights are asleep; wake them before updating them")
        if self._failed_chunk is not None:  # vLLM's worker ended the session at the failed chunk
            raise self._partial("this /update_weights was not sent")
        try:
            return await self._calls.send(call, "/update_weights")
        except UpstreamBadStatus as exc:
            if not _says_no_session(exc):
                self._failed_chunk = self._went_partial(exc)
                raise
            if locked:
                await self._session_lost(exc)
            try:  # outside the lock (the trainer's sends run concurrently): close the session under it
                async with asyncio.timeout(self._settings.lifecycle_queue_timeout_s):
                    await self._lock.acquire()
            except TimeoutError:
                raise exc from None  # the operation holding the lock meets the same answer from vLLM
            try:
                await self._session_lost(exc)
            finally:
                self._lock.release()

    async def _start(self, call: LifecycleCall) -> Reply:
        prev = self._record.state
        drafter = call.op == "start_draft_weight_update"
        if not drafter:  # before the gate holds anything: what the session must change
            await self._checksums.session_starting(weights_current=self._record.weights_stale is None)
        self._failed_chunk = None
        self._record.lifecycle.begin_weight_update()
        # Written ahead: vLLM has no flag for a session, and a proxy killed while this start runs left one open in
        # vLLM that its successor took for none (chaos seed 42). If the start never took, the finish says so.
        self._write_ahead(
            weight_update_session=self._record.next_session_target(drafter).value, session_returns_to=prev.value
        )
        try:
            reply = await self._calls.post(call, f"/{call.op}", hint=prev)
        except UpstreamBadStatus as exc:
            if exc.upstream_status >= 500 and _SESSION_OPEN_MESSAGE in exc.upstream_body:
                self._adopt_open_session(prev, drafter=drafter, exc=exc)
            self._record.settle(prev)
            raise
        self._record.session_opened(return_to=prev, drafter=drafter)
        return reply

    def _adopt_open_session(self, prev: State, *, drafter: bool, exc: UpstreamBadStatus) -> NoReturn:
        """vLLM refused a start because it holds a session already, one this proxy did not open: a killed proxy's, or
        one whose start answered after this proxy gave up on it. The proxy holds it from here, so the trainer's
        finish reaches vLLM (it would refuse a finish for no session it knows of) and inference waits for it."""
        log.warning(
            "vLLM holds a weight update session this proxy did not open; it holds the session until "
            "/finish_weight_update",
            extra={"event": "session_adopted"},
        )
        self._record.session_opened(return_to=prev, drafter=drafter)
        self._record.settle(State.UPDATING_WEIGHTS)
        raise WeightUpdateActive(
            "vLLM already holds a weight update session (opened before a proxy restart, or by a start whose answer "
            "was lost); call /finish_weight_update first",
        ) from exc

    async def _update(self, call: LifecycleCall) -> Reply:
        if self._record.weight_update_active:  # a session opened while this call waited its turn
            return await self.in_session(call, locked=True)
        prev = self._record.state  # no session open: this call is a session of its own
        self._record.lifecycle.begin_weight_update()
        adopted = False
        try:
            reply = await self._calls.post(call, "/update_weights", hint=prev)
            adopted = _inside_a_session(call)
        except UpstreamBadStatus as exc:
            if not _says_no_session(exc):
                self._went_partial(exc)
            raise
        finally:
            if not adopted and self._record.state is State.UPDATING_WEIGHTS:
                self._record.settle(prev)
        if adopted:
            # vLLM's own handler answers 200 only inside a session: one this proxy did not see open (a proxy
            # restarted without its state file, or killed while the start was answered). What the update wrote
            # is not loaded until the finish, which must reach vLLM: the proxy holds the session from here.
            log.warning(
                "vLLM accepted /update_weights inside a weight update session this proxy did not know; it holds "
                "the session until /finish_weight_update",
                extra={"event": "session_adopted"},
            )
            self._record.session_opened(return_to=prev)
            return reply
        self._record.single_update_written()
        await self._label_vllm()
        return reply

    async def _finish(self, call: LifecycleCall) -> Reply:
        if self._failed_chunk is not None:
            await self._finish_partial(call)
        trainer_label = label_sent(call.body, "weight_version")
        if self._record.session_target is not SessionTarget.DRAFTER:  # the label vLLM publishes is the vouched one
            told = self._versions.label_next(trainer_label)
            labelled = with_label(call.body, told) if trainer_label is None else None
            if labelled is not None:
                call = replace(call, body=labelled)
        try:
            reply = await self._calls.post(call, "/finish_weight_update", hint=State.UPDATING_WEIGHTS)
        except UpstreamError as exc:  # the label is not published: a later change must not take it
            self._versions.change_failed()
            if isinstance(exc, UpstreamBadStatus) and _says_no_session(exc):
                await self._session_lost(exc)
            raise
        wrote_model = self._record.session_target is SessionTarget.MODEL
        self._record.session_closed()
        self._versions.change_failed()  # a session that changed nothing the model serves publishes no version
        if trainer_label is not None:
            self._versions.labelled()
        # What vLLM is now, not what it was when the session opened: a call cut by a proxy restart may have landed
        # since (a /pause: settling RUNNING let requests into a paused engine, chaos seed 42), and the reconcile
        # loop leaves a session alone. Its flags, read under the lock before the gate lets anything go, decide.
        await self._calls.adopt_observed(self._record.return_state)
        if wrote_model:  # after the gate let inference go again: a report, never a reason to hold it
            reads = self._checksums.reads
            await self._checksums.session_finished()
            self._bind_digest(reads)
        return reply

    async def _finish_partial(self, call: LifecycleCall) -> NoReturn:
        """The session's finish after a failed chunk: it still reaches vLLM (whose worker may hold the session; the
        trainer starts a new one next), without the label, which must not name partial weights; then 409."""
        body = json_object(call.body) if label_sent(call.body, "weight_version") is not None else None
        if body is not None:
            body.pop("weight_version", None)
            call = replace(call, body=json.dumps(body).encode() if body else b"")
        try:
            await self._calls.send(call, "/finish_weight_update")
        except UpstreamBadStatus:
            pass  # vLLM's worker ended the session at the failure: nothing to close
        self._record.session_abandoned()
        await self._calls.adopt_observed(self._record.return_state)
        error = self._partial("this finish closed the session and published nothing")
        self._failed_chunk = None
        raise error

    def _partial(self, what: str) -> WeightsPartial:
        failed = self._failed_chunk or self._versions.partial_after
        return WeightsPartial(
            f"{failed} failed mid-way and left the weights partial; {what}: start a new weight update session or "
            "reload the weights (inference is held until then)"
        )

    def _went_partial(self, exc: UpstreamBadStatus) -> str | None:
        """An /update_weights failed mid-way (vLLM's worker ends the session at any failure of the transfer): the
        weights are partial until a whole update or a reload, and no label advances onto them. Returns the failed
        call, as its 409s name it; None: refused before anything was written (a body vLLM could not read)."""
        if exc.upstream_status < 500:
            return None
        failed = f"/update_weights ({exc.message})"
        self._versions.went_partial(failed)
        self._record.weights_partial()
        log.warning("%s: the weights are partial; inference held until a whole update or a reload", failed,
                    extra={"event": "weights_partial"})  # fmt: skip
        return failed

    def _bind_digest(self, reads_before: int) -> None:
        """vLLM's checksums read since `reads_before` (after the change) are the new version's."""
        if self._checksums.reads != reads_before and self._checksums.last_digest is not None:
            self._versions.digested(self._checksums.last_digest)

    async def _label_vllm(self) -> None:
        """After a change that carries no label (a reload, a one-call update): vLLM is told the vouched one, so its own
        spans and `/weight_info` name these weights. Best effort: the proxy's relabelling of spans covers a miss."""
        version = self._versions.current
        if version.vllm_label == version.label:
            return
        body = json.dumps({"new_version": version.label}).encode()
        try:
            await self._calls.send(LifecycleCall("update_weight_version", body=body), "/update_weight_version")
        except UpstreamError as exc:
            log.info("vLLM was not told the weight version %s: %s", version.label, exc.message,
                     extra={"event": "weight_version_not_told"})  # fmt: skip
            return
        self._versions.vllm_told(version.label)

    async def _collective_rpc(self, call: LifecycleCall) -> Reply:
        if reloads_checkpoint(call.rpc_method, call.body):  # a new process's own checkpoint, read before it is reloaded
            await self._checksums.before_weights_change()
        if call.rpc_method == RESET_RPC:
            self._record.weights_reset()
        after_discard = self._record.weights_stale is Staleness.DISCARDED
        reply = await self._calls.post(call, "/collective_rpc", hint=self._record.state)
        if call.rpc_method in self._settings.weight_reload_rpc_methods:
            reads = self._checksums.reads
            await self._check_reload(call)
            # Checked while inference is still held: the level-2 wake could not check the adapters. Not while the KV
            # cache still sleeps (SkyRL's order: weights, reload, KV cache): no completion could run.
            checkable = after_discard and not self._record.asleep_tags
            lost = await self._verifier.adapters_lost_in_reload() if checkable else {}
            if after_discard and not checkable:
                self._verifier.reload_check_at_wake()
            self._record.weights_loaded(f"a reload through /collective_rpc ({call.rpc_method})")
            self._bind_digest(reads)
            if lost:
                self._adapters_lost(call, lost)
            await self._label_vllm()
        elif call.rpc_kind is RpcKind.ARM_ADAPTER_ROUND:
            self._record.adapter_round_armed = True
        return reply

    def _adapters_lost(self, call: LifecycleCall, lost: dict[str, tuple[AdapterMark, str]]) -> NoReturn:
        """A LoRA adapter served before a level-2 sleep is gone, or answers as the base model, once the weights are
        back: FAILED (`lora`) as after a wake that lost it (sleep_operations.py), until it is loaded again."""
        self._verifier.adapters_lost(lost)
        detail = lost_detail(problem for _, problem in lost.values())
        self._record.set_failed(
            FailureKind.LORA, f"a LoRA adapter served before the level-2 sleep is lost after the reload: {detail}"
        )
        self._checksums.lie_caught(call.op, CheckName.LORA)
        raise VerificationFailed(
            f"vLLM answered /collective_rpc {call.rpc_method} 200 but lora check failed: {detail}",
            check=CheckName.LORA,
            verification=f"{CheckName.LORA}={CheckResult.FAIL}",
        )

    async def _check_reload(self, call: LifecycleCall) -> None:
        """A reload of the checkpoint must produce the checkpoint's checksums; if not, the weights stay held."""
        if not reloads_checkpoint(call.rpc_method, call.body):
            return
        check = await self._checksums.check_reload()
        if check is None or check.result is not CheckResult.FAIL:
            return
        self._record.mark_stale(Staleness.MISMATCH)
        self._checksums.lie_caught(call.op)
        raise VerificationFailed(
            f"vLLM answered /collective_rpc {call.rpc_method} 200 but {check.name} check failed: {check.detail}",
            check=CheckName.WEIGHTS,
            verification=f"{check.name}={check.result}",
        )

    async def _session_lost(self, exc: UpstreamBadStatus) -> NoReturn:
        """vLLM holds no weight update session while we hold one: it restarted between two reconcile
        rounds (or the start never took). Left open, the proxy would refuse every call but a finish that
        vLLM keeps refusing. Close ours, treat it as the restart it almost surely was, and say so."""
        if self._record.weight_update_active:
            hint = self._record.return_state
            self._record.restarted_unseen("vLLM lost the weight update session")
            # Or a finish took whose answer was lost (a proxy restart cut it): blocks of the weights before may be
            # cached. Not after a failed chunk: vLLM's worker ended the session there, and the weights are partial.
            if self._versions.partial_after is None:
                self._record.weights_committed("vLLM holds no weight update session: its finish may have taken")
            await self._calls.adopt_observed(hint)
        raise WeightUpdateSessionLost(
            "vLLM has no weight update session open (it restarted, or the start did not take); the proxy "
            "closed its own and marked the weights stale: start a new session",
        ) from exc


def _inside_a_session(call: LifecycleCall) -> bool:
    """vLLM's own /update_weights (body `update_info`), which fails outside a session; not a server's own route
    of that name that loads whole weights (prime-rl's `{"weight_dir"}`)."""
    try:
        body = json.loads(call.body) if call.body else None
    except ValueError:
        return False
    return isinstance(body, dict) and "update_info" in body


def _says_no_session(exc: UpstreamBadStatus) -> bool:
    return any(m in exc.upstream_body for m in _NO_SESSION_MESSAGES)
