"""`CheckpointOperations`: vLLM 0.34's process checkpoint (`/checkpoint/prepare`, `/checkpoint/restore`), guarded like a
sleep: run under the coordinator's lock, inference held from the prepare until the restore is verified.

vLLM's prepare drains with `pause_generation(mode)`, releases the KV cache and the communicators, and answers 200 with
the state: `prepared`, `preparing` while a wait-mode drain runs, or `failed` (`serve/checkpoint/api_router.py`,
`EngineCore.checkpoint_prepare`). The restore maps the KV cache back and resumes scheduling. The restore is verified as
vLLM's own snapshot check verifies one (`vllm/snapshot/`): a greedy one-token completion of a fixed prompt, compared
by token ids, text and logprob within 1e-3 with the one taken before the prepare; and by the flags, the GPUs' memory,
the golden canary and the weight checksums where they are on.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Settings
from ..errors import UpstreamError, UpstreamUnreachable, VerificationFailed
from ..observe.metrics import EngineMetrics
from ..upstream.vllm_client import Reply, VllmClient
from .engine_calls import EngineCalls
from .outcome import Outcome
from .parsed_calls import LifecycleCall
from .record import EngineRecord, FailureKind
from .rules import WEIGHTLESS
from .states import State
from .verdict import Check, CheckName, CheckResult, Verdict
from .verifier import Expectation, MemoryChange, Verifier
from .weight_checksums import WeightChecksums

#: vLLM's snapshot check compares the logprob with `abs_tol=1e-3` (vllm/snapshot/).
SNAPSHOT_LOGPROB_TOLERANCE = 1e-3
#: How often `/checkpoint/status` is read while a wait-mode drain runs.
STATUS_POLL_S = 0.05

Lie = Callable[..., VerificationFailed]


@dataclass(frozen=True)
class Snapshot:
    """The greedy one-token answer vLLM's snapshot check compares across a checkpoint."""

    token_ids: tuple[int, ...]
    text: str
    logprob: float

    def differs_from(self, before: Snapshot) -> str | None:
        if self.token_ids != before.token_ids or self.text != before.text:
            now, then = f"{self.text!r} {list(self.token_ids)}", f"{before.text!r} {list(before.token_ids)}"
            return f"answers {now}; before the prepare {then}"
        if not math.isclose(self.logprob, before.logprob, rel_tol=0, abs_tol=SNAPSHOT_LOGPROB_TOLERANCE):
            return f"logprob {self.logprob:.5f}; before the prepare {before.logprob:.5f} (tolerance 1e-3)"
        return None


class CheckpointOperations:
    def __init__(
        self,
        settings: Settings,
        client: VllmClient,
        record: EngineRecord,
        calls: EngineCalls,
        verifier: Verifier,
        checksums: WeightChecksums,
        metrics: EngineMetrics,
        lie: Lie,
    ) -> None:
        self._settings = settings
        self._client = client
        self._record = record
        self._calls = calls
        self._verifier = verifier
        self._checksums = checksums
        self._metrics = metrics
        self._lie = lie
        # The answer taken before the prepare; None: none could be taken (not RUNNING, canary off, weights held).
        self.snapshot: Snapshot | None = None

    async def run(self, call: LifecycleCall) -> Outcome:
        return await (self.prepare(call) if call.op == "checkpoint_prepare" else self.restore(call))

    async def prepare(self, call: LifecycleCall) -> Outcome:
        prev = self._record.state
        before = await self._verifier.read_memory()
        self.snapshot = None
        if prev is State.RUNNING and self._record.weights_stale is None:
            self._verifier.note_awake(before)
            self.snapshot = await self._taken()
            await self._checksums.before_sleep(1)  # the process keeps its weights: compared after the restore
        self._record.lifecycle.begin_checkpoint()
        reply = await self._calls.post(call, "/checkpoint/prepare", hint=prev)
        state, error = _state_of(reply)
        if state == "preparing":
            state, error = await self._drained(prev)
        if state != "prepared":
            raise self._failed(call, state, error)
        expect = Expectation(sleeping=True, paused=True, memory=MemoryChange.PART_FREED)
        verdict = await self._verifier.verify(expect, memory_before=before)
        verdict.checks.append(Check(CheckName.CHECKPOINT, CheckResult.PASS, "prepared"))
        failed = verdict.failed
        if failed is not None and failed.name is not CheckName.MEMORY:
            raise self._lie(call, verdict, hint=State.CHECKPOINTED)
        self._record.settle(State.CHECKPOINTED)
        if failed is not None:  # prepared by vLLM's own word, but its KV cache still there: held as prepared
            raise self._lie(call, verdict, hint=State.CHECKPOINTED, adopt=False)
        return _answer({"state": "prepared"}, verdict)

    async def restore(self, call: LifecycleCall) -> Outcome:
        before = await self._verifier.read_memory()
        self._record.lifecycle.begin_restore()
        reply = await self._calls.post(call, "/checkpoint/restore", hint=State.CHECKPOINTED)
        state, error = _state_of(reply)
        if state not in (None, "running"):
            raise self._failed(call, state, error)
        canary = self._record.weights_stale not in WEIGHTLESS
        expect = Expectation(sleeping=False, paused=False, memory=MemoryChange.RESTORED, canary=canary)
        verdict = await self._verifier.verify(expect, memory_before=before)
        if verdict.failed is not None:
            raise self._lie(call, verdict, hint=State.CHECKPOINTED)
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is not None:
            check = await self._compared(snapshot)
            verdict.checks.append(check)
            if check.result is CheckResult.FAIL:
                why = f"the engine answers otherwise after its restore: {check.detail}"
                self._record.set_failed(FailureKind.GARBAGE, why)
                raise self._lie(call, verdict, hint=State.RUNNING, adopt=False)
        weights = await self._checksums.check_wake()
        if weights is not None:
            verdict.checks.append(weights)
            if weights.result is CheckResult.FAIL:
                self._record.weights_mismatched()
        if verdict.memory is not None:
            self._verifier.note_awake(verdict.memory)
        if (mode := self._record.user_pause) is not None:  # vLLM's restore resumed scheduling: the pause stays
            await self._calls.post(LifecycleCall("pause", (("mode", mode),), mode=mode), "/pause", hint=State.PAUSED)
            self._record.settle(State.PAUSED)
        else:
            self._record.settle(State.RUNNING)
        if weights is not None and weights.result is CheckResult.FAIL:
            raise self._lie(call, verdict, hint=State.RUNNING, adopt=False)
        return _answer({"state": "running"}, verdict)

    async def _drained(self, prev: State) -> tuple[str | None, str | None]:
        """A wait-mode prepare answered `preparing`: read `/checkpoint/status` until the drain ends, at most
        `lifecycle_call_timeout_s`."""
        deadline = time.monotonic() + self._settings.lifecycle_call_timeout_s
        while True:
            state, error = await self._client.checkpoint_state()
            if state is None:
                await self._calls.adopt_observed(prev)
                raise UpstreamUnreachable("vLLM stopped answering /checkpoint/status while it prepared a checkpoint")
            if state != "preparing" or time.monotonic() >= deadline:
                return state, error
            await asyncio.sleep(STATUS_POLL_S)

    def _failed(self, call: LifecycleCall, state: str | None, error: str | None) -> VerificationFailed:
        """vLLM answered 200 but its checkpoint is not where the call puts it: a failed checkpoint is out of service
        until vLLM restarts; one still draining is held as prepared (a restore or a restart ends it)."""
        detail = f"its checkpoint state is {state}" + (f": {error}" if error else "")
        if state == "failed":
            self._record.set_failed(FailureKind.CHECKPOINT, f"vLLM's process checkpoint failed: {error}")
        else:
            self._record.settle(State.CHECKPOINTED)
        verdict = Verdict([Check(CheckName.CHECKPOINT, CheckResult.FAIL, detail)])
        return self._lie(call, verdict, hint=State.CHECKPOINTED, adopt=False)

    async def _taken(self) -> Snapshot | None:
        if not self._settings.canary_enabled:
            return None
        try:
            return await self._snapshot()
        except (UpstreamError, ValueError, KeyError, TypeError, IndexError):
            return None  # nothing to compare with: the restore is verified by the other checks

    async def _compared(self, before: Snapshot) -> Check:
        try:
            now = await self._snapshot()
        except (UpstreamError, ValueError, KeyError, TypeError, IndexError) as exc:
            return Check(CheckName.SNAPSHOT, CheckResult.FAIL, f"the snapshot completion failed: {exc}")
        problem = now.differs_from(before)
        if problem is not None:
            return Check(CheckName.SNAPSHOT, CheckResult.FAIL, problem)
        return Check(CheckName.SNAPSHOT, CheckResult.PASS, f"answers {now.text!r} as before the prepare")

    async def _snapshot(self) -> Snapshot:
        """vLLM's snapshot probe: the canary prompt, greedy, one token, with its logprob and its token ids."""
        choice = await self._verifier.canary_choice(logprobs=0, return_token_ids=True)
        logprob = choice["logprobs"]["token_logprobs"][0]
        ids = choice.get("token_ids") or ()
        return Snapshot(tuple(int(i) for i in ids), str(choice["text"]), float("nan") if logprob is None else logprob)


def _state_of(reply: Reply) -> tuple[str | None, str | None]:
    """`CheckpointStateResponse`'s state and error; (None, None) for a body without one."""
    try:
        payload = reply.json()
    except ValueError:
        return None, None
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), str):
        return None, None
    error = payload.get("error")
    return payload["state"], str(error) if error is not None else None


def _answer(body: dict[str, str], verdict: Verdict) -> Outcome:
    return Outcome(200, json.dumps(body).encode(), "application/json", verdict)
