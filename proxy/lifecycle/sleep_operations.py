"""`SleepOperations`: sleep, wake_up, release_kv_cache_memory, pause and resume, each verified; and the worker
RPCs that sleep and wake the engine's memory behind vLLM's executor (proxy/lifecycle/worker_rpcs.py).

The coordinator runs them under its lock, from a state `rules.judge` accepted: begin trigger (the gate
starts holding) -> the call to vLLM, watched for engine death -> verification -> settle, or adopt what the
engine really is and raise the caught "200 lie" (503 verification_failed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from ..config import Settings
from ..errors import VerificationFailed
from ..observe.metrics import EngineMetrics
from .engine_calls import EngineCalls
from .gate import RequestGate
from .outcome import Outcome, from_vllm
from .parsed_calls import LifecycleCall
from .record import EngineRecord, FailureKind
from .rules import WEIGHTLESS, Staleness, wake_targets
from .sleep_completion import sleep_sent
from .states import State
from .verdict import CheckName, CheckResult, Verdict
from .verifier import Expectation, MemoryChange, Verifier
from .weight_checksums import WeightChecksums
from .worker_rpcs import RpcKind

SLEEP_OPERATIONS = frozenset({"sleep", "wake_up", "release_kv_cache_memory", "pause", "resume"})


class SleepOperations:
    def __init__(
        self,
        settings: Settings,
        record: EngineRecord,
        calls: EngineCalls,
        verifier: Verifier,
        gate: RequestGate,
        metrics: EngineMetrics,
        write_ahead: Callable[..., None],
        checksums: WeightChecksums,
        end_forwarded: Callable[[str], None],
    ) -> None:
        self._settings = settings
        self._record = record
        self._calls = calls
        self._verifier = verifier
        self._gate = gate
        self._metrics = metrics
        self._write_ahead = write_ahead
        self._checksums = checksums
        self._end_forwarded = end_forwarded

    async def run(self, call: LifecycleCall) -> Outcome:
        """One of SLEEP_OPERATIONS, under the coordinator's lock."""
        operations: dict[str, Callable[[LifecycleCall], Awaitable[Outcome]]] = {
            "sleep": self.sleep,
            "wake_up": self.wake_up,
            "release_kv_cache_memory": self.release_kv_cache_memory,
            "pause": self.pause,
            "resume": self.resume,
        }
        return await operations[call.op](call)

    async def run_worker_rpc(self, call: LifecycleCall) -> Outcome:
        """A `/collective_rpc` of kind SLEEP_FOR_SYNC or WAKE_FOR_SYNC, under the coordinator's lock."""
        if call.rpc_kind is RpcKind.SLEEP_FOR_SYNC:
            return await self._sleep_for_sync(call)
        return await self._wake_for_sync(call)

    async def _sleep_for_sync(self, call: LifecycleCall) -> Outcome:
        """From PAUSED: the pools freed; vLLM's flags stay "paused" (its executor does not know)."""
        assert call.rpc is not None
        before = await self._verifier.read_memory()
        self._record.lifecycle.begin_sleep()
        # written ahead, as for a level-2 sleep: a proxy killed while this runs must not trust the weights after it
        self._write_ahead(weights_stale=Staleness.DISCARDED)
        reply = await self._calls.post(call, "/collective_rpc", hint=State.PAUSED)
        verdict = await self._verifier.verify(
            Expectation(sleeping=True, paused=True, memory=MemoryChange.FREED), memory_before=before
        )
        if verdict.failed is not None and verdict.failed.name is not CheckName.MEMORY:
            raise self._lie(call, verdict, hint=State.PAUSED)
        # Held asleep even when the GPUs showed nothing freed: only its wake may map the pools back.
        self._record.fell_asleep_in_worker(call.rpc.tags)
        self._record.settle(State.SLEEPING)
        if verdict.failed is not None:
            raise self._lie(call, verdict, hint=State.SLEEPING, adopt=False)
        return from_vllm(reply, verdict)

    async def _wake_for_sync(self, call: LifecycleCall) -> Outcome:
        """Maps back the pools named; the scheduler stays paused, so no canary can run: the next /resume runs it."""
        assert call.rpc is not None
        view = self._record.view()
        remaining = view.asleep_tags - call.rpc.tags
        before = await self._verifier.read_memory()
        self._record.lifecycle.begin_wake()
        reply = await self._calls.post(call, "/collective_rpc", hint=State.SLEEPING)
        memory = MemoryChange.PART_RESTORED if remaining else MemoryChange.RESTORED
        expect = Expectation(sleeping=True, paused=True, memory=memory)
        verdict = await self._verifier.verify(expect, memory_before=before)
        if verdict.failed is not None:
            self._record.settle(State.SLEEPING)  # what we sent is still asleep: a retry is sent again
            raise self._lie(call, verdict, hint=State.SLEEPING, adopt=verdict.failed.name is not CheckName.MEMORY)
        self._record.woke(remaining)
        if remaining:
            self._record.settle(State.SLEEPING)
            return from_vllm(reply, verdict)
        if verdict.memory is not None:
            self._verifier.note_awake(verdict.memory)
        self._record.canary_due = True
        if self._record.user_pause is None:
            self._record.paused_by_user("keep")  # it was paused before the sleep, and nothing resumed it
        self._record.settle(State.PAUSED)
        return from_vllm(reply, verdict)

    async def sleep(self, call: LifecycleCall) -> Outcome:
        level = call.level if call.level is not None else 1
        before = await self._verifier.read_memory()
        if self._record.state is State.RUNNING:
            self._verifier.note_awake(before)
        prev = self._record.state
        if prev is State.RUNNING and self._record.weights_stale is None:
            await self._verifier.record_adapters()  # an adapter loaded since the last round is found again too
        if prev is not State.SLEEPING:
            self._verifier.adapters_before_sleep()
            # Taken before the gate holds anything: the weights a level-1 wake must bring back bit for bit.
            # Also a restarted vLLM's checkpoint (served, though "stale"); not weights nothing may run on anyway.
            servable = self._record.weights_stale not in WEIGHTLESS and not self._record.asleep_tags
            await self._checksums.before_sleep(level if servable else None)
        if prev is State.SLEEPING:
            self._record.lifecycle.begin_sleep_again()
        else:
            self._record.lifecycle.begin_sleep()
        drained = None
        if self._settings.drain_before_sleep_s > 0 and call.mode == "abort" and self._gate.inflight:
            self._metrics.policy_action("drain_before_sleep")
            idle = await self._gate.wait_idle(self._settings.drain_before_sleep_s)
            drained = "complete" if idle else f"timeout; {self._gate.inflight} aborted"
        if level == 2:  # written ahead: a proxy killed while this runs must not trust the weights after it
            self._write_ahead(weights_stale=Staleness.DISCARDED)
        reply = await sleep_sent(self._calls, self._verifier, call, hint=prev)
        expect = Expectation(sleeping=True, paused=True, memory=MemoryChange.FREED if level >= 1 else None)
        verdict = await self._verifier.verify(expect, memory_before=before)
        failed = verdict.failed
        if failed is not None and not (
            failed.name is CheckName.MEMORY and verdict.observation and verdict.observation.sleeping
        ):
            raise self._lie(call, verdict, hint=prev)
        self._record.fell_asleep(level, confirmed=failed is None)
        if prev is State.PAUSED and self._record.user_pause is None:
            self._record.paused_by_user("abort")
        self._record.settle(State.SLEEPING)
        if failed is not None:
            # Asleep by the flags, nothing freed: asleep without freeing, or only paused (a /sleep from PAUSED
            # that did nothing looks the same). Held as asleep (no /resume, no weight writes onto weights that
            # may sleep), and a repeat is sent to vLLM again instead of being answered as a no-op.
            raise self._lie(call, verdict, hint=State.SLEEPING, adopt=False)
        return from_vllm(reply, verdict, drained=drained)

    async def wake_up(self, call: LifecycleCall) -> Outcome:
        view = self._record.view()
        targets = wake_targets(call, view)
        remaining = frozenset() if view.asleep_tags == {"scheduling"} else view.asleep_tags - targets
        full = not remaining
        if call.tags is None or view.asleep_tags == {"scheduling"}:
            sent = call
        else:  # only what is still asleep: vLLM's repeat of an awake tag is a silent no-op at best
            sent = LifecycleCall("wake_up", tuple(("tags", t) for t in sorted(targets)), tags=tuple(sorted(targets)))
        # With checksums to compare the weights with, the check can only come once vLLM is awake, and vLLM resumes
        # what it kept through the sleep (`mode=keep`) as it wakes: kept requests ran on weights that failed them
        # (issue 49). They are ended before the wake instead, as a level-2 sleep's are.
        checked = full and self._checksums.wake_check_due
        if checked and self._gate.inflight:
            self._end_forwarded("the engine's weights are checked after its wake, and vLLM resumes what it kept "
                                "through the sleep as it wakes: ended before the wake")  # fmt: skip
        before = await self._verifier.read_memory()
        self._record.lifecycle.begin_wake()
        reply = await self._calls.post(sent, "/wake_up", hint=State.SLEEPING)
        memory = None
        if view.sleep_level != 0:
            memory = MemoryChange.RESTORED if full else MemoryChange.PART_RESTORED
        canary = full and self._record.weights_stale not in WEIGHTLESS
        # The checksums come before the canary: no canary runs on weights known to be other (nothing may run on them,
        # and its answer would become the golden one).
        expect = Expectation(
            sleeping=not full, paused=None if not full else False, memory=memory, canary=canary and not checked
        )
        verdict = await self._verifier.verify(expect, memory_before=before)
        if verdict.failed is not None:
            if not full and verdict.failed.name is CheckName.MEMORY:
                # The flags cannot show a partial wake; the GPUs say nothing came back: what we sent is
                # still asleep (a retry is sent again), not an engine to give up on.
                self._record.settle(State.SLEEPING)
                raise self._lie(call, verdict, hint=State.SLEEPING, adopt=False)
            raise self._lie(call, verdict, hint=State.SLEEPING)
        # Inside the wake, inference still held: the weights must be those before a level-1 sleep, bit for bit.
        weights = await self._checksums.check_wake() if full else None
        if weights is not None:
            verdict.checks.append(weights)
            if weights.result is CheckResult.FAIL:  # awake, as vLLM says, on weights nothing may run on
                self._record.weights_mismatched()
            elif canary:
                answered = await self._verifier.verify(replace(expect, memory=None, canary=True), memory_before=None)
                verdict.checks.extend(c for c in answered.checks if c.name is not CheckName.FLAGS)
                if answered.failed is not None:
                    raise self._lie(call, answered, hint=State.SLEEPING)
        self._record.woke(remaining)
        if not full:
            self._record.settle(State.SLEEPING)
            return from_vllm(reply, verdict)
        if verdict.memory is not None:
            self._verifier.note_awake(verdict.memory)
        if (mode := self._record.user_pause) is not None:
            # vLLM's /wake_up resumes a paused scheduler; the user's pause must survive a sleep/wake cycle.
            await self._calls.post(LifecycleCall("pause", (("mode", mode),), mode=mode), "/pause", hint=State.PAUSED)
            repaused = await self._verifier.verify(Expectation(sleeping=True, paused=True), memory_before=None)
            if repaused.failed is not None:
                raise self._lie(call, repaused, hint=State.PAUSED)
            self._record.settle(State.PAUSED)
            outcome = from_vllm(reply, verdict, pause_kept=mode)
        else:
            self._record.settle(State.RUNNING)
            outcome = from_vllm(reply, verdict)
        if weights is not None and weights.result is CheckResult.FAIL:
            raise self._lie(call, verdict, hint=State.RUNNING, adopt=False)
        return outcome

    async def release_kv_cache_memory(self, call: LifecycleCall) -> Outcome:
        before = await self._verifier.read_memory()
        self._verifier.adapters_before_sleep()
        self._record.lifecycle.begin_sleep()
        reply = await self._calls.post(call, "/release_kv_cache_memory", hint=State.PAUSED)
        verdict = await self._verifier.verify(
            Expectation(sleeping=True, paused=True, memory=MemoryChange.PART_FREED), memory_before=before
        )
        failed = verdict.failed
        if failed is not None and failed.name is not CheckName.MEMORY:
            raise self._lie(call, verdict, hint=State.PAUSED)
        self._record.released_kv_cache()
        self._record.settle(State.SLEEPING)
        if failed is not None:
            # Paused by the flags, nothing freed: a wake is still what brings it back, so it is held as released.
            raise self._lie(call, verdict, hint=State.SLEEPING, adopt=False)
        return from_vllm(reply, verdict)

    async def pause(self, call: LifecycleCall) -> Outcome:
        self._record.lifecycle.begin_pause()
        reply = await self._calls.post(call, "/pause", hint=State.RUNNING)
        verdict = await self._verifier.verify(Expectation(sleeping=True, paused=True), memory_before=None)
        if verdict.failed is not None:
            raise self._lie(call, verdict, hint=State.RUNNING)
        self._record.paused_by_user(call.mode or "abort")
        self._record.settle(State.PAUSED)
        return from_vllm(reply, verdict)

    async def resume(self, call: LifecycleCall) -> Outcome:
        # Memory mapped back while paused (a worker RPC's wake) is first checked here, once it can answer.
        canary = self._record.canary_due and self._record.weights_stale is None
        self._record.lifecycle.begin_resume()
        reply = await self._calls.post(call, "/resume", hint=State.PAUSED)
        expect = Expectation(sleeping=False, paused=False, canary=canary)
        verdict = await self._verifier.verify(expect, memory_before=None)
        if verdict.failed is not None:
            raise self._lie(call, verdict, hint=State.PAUSED)
        self._record.canary_due = False
        self._record.pause_lifted()
        self._record.settle(State.RUNNING)
        return from_vllm(reply, verdict)

    def _lie(self, call: LifecycleCall, verdict: Verdict, *, hint: State, adopt: bool = True) -> VerificationFailed:
        """A caught "200 lie": counted, what the engine really is adopted (unless `adopt` is False), and the
        error to raise returned."""
        check = verdict.failed
        assert check is not None
        self._metrics.lie_caught(call.op, check.name)
        obs = verdict.observation
        if adopt:
            if check.name is CheckName.CANARY:
                self._record.set_failed(
                    FailureKind.GARBAGE, f"the engine produces garbage after {call.op}: {check.detail}"
                )
            elif check.name is CheckName.LORA:
                self._record.set_failed(
                    FailureKind.LORA, f"a LoRA adapter served before the sleep is lost after {call.op}: {check.detail}"
                )
            elif check.name is CheckName.MEMORY and call.op == "wake_up":
                self._record.set_failed(
                    FailureKind.MEMORY, f"the engine says awake but its memory is not back: {check.detail}"
                )
            elif obs is not None:
                memory = verdict.memory or self._verifier.last_memory
                freed = self._verifier.memory_freed(memory) if memory is not None else None
                self._record.adopt(obs, hint=hint, memory_freed=freed)
        return VerificationFailed(
            f"vLLM answered /{call.op} 200 but {check.name} check failed: {check.detail}",
            check=check.name,
            verification=verdict.summary(),
        )
