"""`Verifier`: after vLLM answers a lifecycle call 200, check that the engine really got there.

Four kinds of check, each with its own deadline: flags (`/health`, `/is_sleeping`, `/is_paused`), memory (the GPUs'
used memory moved as promised), canary (a greedy completion matches the golden answer) and LoRA (adapters listed
before a sleep are listed and answer as before). The verifier reports; the coordinator decides. The lie classes
each check catches: docs/verification.md.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..errors import UpstreamError
from ..gpu.footprint import Footprint
from ..gpu.readers import GpuMemoryReader, GpuReading
from ..upstream.observation import LateReads, Observation
from ..upstream.vllm_client import VllmClient
from .verdict import Check, CheckName, CheckResult, Verdict


class MemoryChange(enum.StrEnum):
    """How the GPUs' used memory must move after an operation, relative to the awake footprint."""

    FREED = "freed"  # a level-1/2 sleep
    PART_FREED = "part_freed"  # /release_kv_cache_memory
    RESTORED = "restored"  # a full wake
    PART_RESTORED = "part_restored"  # a partial wake


@dataclass(frozen=True)
class Expectation:
    """The state an operation promises."""

    sleeping: bool
    paused: bool | None = None
    memory: MemoryChange | None = None
    canary: bool = False


@dataclass(frozen=True)
class CanaryAnswer:
    text: str
    logprob: float


#: The canary of an adapter whose one-token answer is the base model's: one token could not tell it from the base
#: model it turns into when a wake loses it (vLLM #53888), so it is asked for this many.
ADAPTER_CANARY_TOKENS = 8


@dataclass(frozen=True)
class AdapterMark:
    """A LoRA adapter as last seen healthy: where vLLM loaded it from, and its canary answer (None: not recorded), of
    `tokens` tokens."""

    root: str | None
    golden: CanaryAnswer | None = None
    tokens: int = 1


def listed_adapters(payload: object) -> dict[str, str | None]:
    """The LoRA adapters in vLLM's `/v1/models` body: its cards with a `parent` (the base model's card has none),
    by id, with their `root` (the path vLLM loaded them from). ValueError saying what is wrong with the body."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("the body is not a model list (no 'data' list)")
    adapters: dict[str, str | None] = {}
    for card in payload["data"]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise ValueError(f"a model card without an id: {card!r:.200}")
        if card.get("parent") is not None:
            root = card.get("root")
            adapters[card["id"]] = root if isinstance(root, str) else None
    return adapters


class Verifier:
    def __init__(
        self,
        client: VllmClient,
        gpu: GpuMemoryReader,
        settings: Settings,
        *,
        footprint: Footprint | None = None,
        on_check: Callable[[str, str], None] = lambda check, result: None,
        on_memory: Callable[[GpuReading], None] = lambda reading: None,
    ) -> None:
        self._client = client
        self._gpu = gpu
        self._settings = settings
        self._on_check = on_check
        self._on_memory = on_memory
        self.footprint = footprint if footprint is not None else Footprint()
        self.golden: CanaryAnswer | None = None
        self.last: Verdict | None = None
        self.last_memory: GpuReading | None = None
        self._model: str | None = None
        # LoRA adapters: as seen while healthy, as they were when the last sleep began, and those a check found lost.
        self.adapters: dict[str, AdapterMark] = {}
        self._before_sleep: dict[str, AdapterMark] = {}
        self.lost_adapters: dict[str, AdapterMark] = {}
        self._adapters_reloaded = False
        # The adapters recorded when the last sleep began, and the base model's answer then, kept through a level-2
        # discard for the reload after it: that wake cannot check them (no canary runs on discarded weights).
        self._kept_for_reload: dict[str, AdapterMark] = {}
        self._base_at_sleep: CanaryAnswer | None = None
        # That reload came while the KV cache slept (SkyRL's order): its check is due at the KV cache's wake.
        self._reload_check_due = False
        # The prefix cache's partition (prefix_cache.py) the canary carries while old-weight blocks remain.
        self.cache_salt: str | None = None
        self._last_answer: CanaryAnswer | None = None

    async def read_memory(self) -> GpuReading:
        reading = await self._gpu.read()
        self.last_memory = reading
        self._on_memory(reading)
        return reading

    async def verify(self, expect: Expectation, *, memory_before: GpuReading | None) -> Verdict:
        started = time.monotonic()
        verdict = Verdict()
        flags = await self._check_flags(expect, verdict)
        if flags.result is CheckResult.PASS and expect.memory is not None:
            memory = await self._check_memory(expect.memory, memory_before, verdict)
            self._add(verdict, memory)
            if memory.result is CheckResult.FAIL:
                # The memory is polled up to the deadline: what vLLM's flags said before may no longer hold (it died and
                # came back awake meanwhile, chaos seed 7 with checksums on), and the caller decides from them.
                verdict.observation = await self._client.observe()
        if verdict.failed is None and expect.canary and self._settings.canary_enabled:
            self._add(verdict, await self._check_canary())
        if verdict.failed is None and expect.canary and self._before_sleep:
            self._add(verdict, await self._check_adapters())
        if verdict.failed is None and expect.canary and self._reload_check_due:
            self._add(verdict, await self._check_reloaded_adapters())
        verdict.seconds = time.monotonic() - started
        self.last = verdict
        return verdict

    def note_awake(self, reading: GpuReading) -> None:
        """Record the awake footprint (proxy/gpu/footprint.py); memory checks are relative to it."""
        self.footprint.note_awake(reading)

    def memory_freed(self, reading: GpuReading) -> bool | None:
        """Whether `reading` shows a level-1/2 sleep's memory gone; None when we cannot tell."""
        if not reading.available or not self.footprint.awake_reading:
            return None
        return self._memory_problem(MemoryChange.FREED, reading, None) is None

    async def recheck(self, failure: str, reading: GpuReading, *, canary: bool) -> Check:
        """One quick look, without polling, at an awake engine that failed verification ("garbage" or
        "memory"): the first failing check, or the last passing one. A canary that timed out under load
        or a reader that lagged must not hold the engine FAILED until someone restarts it."""
        if failure == "memory":
            problem = self._memory_problem(MemoryChange.RESTORED, reading, None) if reading.available else "unavailable"
            if problem is not None:
                return Check(CheckName.MEMORY, CheckResult.FAIL, problem)
        if self._settings.canary_enabled and (canary or failure == "garbage"):
            return await self._check_canary()
        return Check(CheckName.MEMORY, CheckResult.PASS, "restored")

    def forget_golden(self) -> None:
        """New weights legitimately change the answer: the next passing canary becomes the golden one."""
        self.golden = None
        self._forget_recorded()

    def forget_adapters(self) -> None:
        """A LoRA load or unload went through: nothing recorded about the adapters holds."""
        self._forget_recorded()
        self._kept_for_reload, self._reload_check_due = {}, False

    def _forget_recorded(self) -> None:
        """The adapters (or the weights under them) changed legitimately: a LoRA load or unload went through, or the
        weights were replaced. Nothing recorded about them holds; the next healthy round records them again."""
        self.adapters = {}
        self._before_sleep = {}
        self._adapters_reloaded = True

    # ----- LoRA adapters
    async def record_adapters(self) -> None:
        """On an engine known good (RUNNING, weights current): the adapters vLLM lists, each with its canary answer
        (at most `lora_canary_max_adapters` answered). An unreadable /v1/models leaves what was recorded."""
        if not self._settings.lora_check:
            return
        try:
            listed = await self._listed_adapters()
        except (UpstreamError, ValueError):
            return
        marks = {name: mark for name, mark in self.adapters.items() if listed.get(name, "") == mark.root}
        for name, root in listed.items():
            marks.setdefault(name, AdapterMark(root))
        answered = sum(1 for mark in marks.values() if mark.golden is not None)
        for name, mark in marks.items():
            if mark.golden is not None or not self._settings.canary_enabled:
                continue
            if answered >= self._settings.lora_canary_max_adapters:
                break
            tokens = 1
            try:
                answer = await self._canary(model=name)
                base = self.golden or self._last_answer
                if base is not None and self._same(answer, base):  # a loss would go unseen: ask for more tokens
                    tokens = ADAPTER_CANARY_TOKENS
                    answer = await self._canary(model=name, tokens=tokens)
            except (UpstreamError, ValueError, KeyError, TypeError, IndexError):
                continue
            if math.isfinite(answer.logprob):
                marks[name] = AdapterMark(mark.root, answer, tokens)
                answered += 1
        self.adapters = marks

    def adapters_before_sleep(self) -> None:
        """A sleep begins: the adapters to find again after the wake are those recorded now."""
        self._before_sleep = dict(self.adapters) if self._settings.lora_check else {}
        self._kept_for_reload, self._base_at_sleep = dict(self._before_sleep), self.golden or self._last_answer
        self._adapters_reloaded = self._reload_check_due = False

    async def adapters_lost_in_reload(self) -> dict[str, tuple[AdapterMark, str]]:
        """After a reload of weights a level-2 sleep discarded: the adapters listed when that sleep began that are gone,
        or answer as the base model does though they answered apart from it then (vLLM #53888 in a level-2 cycle),
        each with the problem. Kept by `adapters_lost` once the weights are marked loaded."""
        kept, base_then = self._kept_for_reload, self._base_at_sleep
        self._kept_for_reload = {}
        if not kept or not self._settings.lora_check or not self._settings.canary_enabled:
            return {}
        try:
            listed = await self._listed_adapters()
            base_now = await self._canary()
        except (UpstreamError, ValueError, KeyError, TypeError, IndexError):
            return {}
        lost: dict[str, tuple[AdapterMark, str]] = {}
        for name, mark in sorted(kept.items()):
            if name not in listed:
                lost[name] = (mark, f"adapter {name!r} (loaded from {mark.root}) is no longer listed by /v1/models")
            elif mark.golden is not None and base_then is not None and not self._same(mark.golden, base_then):
                try:
                    answer = await self._canary(model=name, tokens=mark.tokens)
                    base = base_now if mark.tokens == 1 else await self._canary(tokens=mark.tokens)
                except (UpstreamError, ValueError, KeyError, TypeError, IndexError):
                    continue
                if self._same(answer, base):
                    then = f"before the sleep it answered {mark.golden.text!r}, the base model {base_then.text!r}"
                    lost[name] = (mark, f"adapter {name!r} answers {answer.text!r} as the base model does; {then}")
        return lost

    def reload_check_at_wake(self) -> None:
        """A reload of weights a level-2 sleep discarded came while the KV cache sleeps (SkyRL's order: weights, reload,
        KV cache): no completion can run yet, so its adapters are checked at the wake that brings the KV cache back."""
        self._reload_check_due = bool(self._kept_for_reload)

    async def _check_reloaded_adapters(self) -> Check:
        """At that wake: `adapters_lost_in_reload`'s rule, as one check of the wake."""
        self._reload_check_due = False
        lost = await self.adapters_lost_in_reload()
        if not lost:
            return Check(CheckName.LORA, CheckResult.PASS, "the adapters of before the level-2 sleep are not lost")
        self.adapters_lost(lost)
        return Check(CheckName.LORA, CheckResult.FAIL, lost_detail(p for _, p in lost.values()), sorted(lost))

    def adapters_lost(self, lost: dict[str, tuple[AdapterMark, str]]) -> None:
        """`adapters_lost_in_reload` found these: held lost until each is loaded again or unloaded."""
        self.lost_adapters = {name: mark for name, (mark, _) in lost.items()}
        self._adapters_reloaded = False

    async def _listed_adapters(self) -> dict[str, str | None]:
        reply = await self._client.call("GET", "/v1/models", headers=self._auth())
        if reply.status != 200:
            raise ValueError(f"status {reply.status}: {reply.message()}")
        return listed_adapters(reply.json())

    async def _check_adapters(self) -> Check:
        """After a full wake: every adapter listed before the sleep is listed and answers as it did then."""
        before, self._before_sleep = self._before_sleep, {}
        self._kept_for_reload = {}
        try:
            listed = await self._listed_adapters()
        except (UpstreamError, ValueError) as exc:
            self.lost_adapters = before
            return Check(CheckName.LORA, CheckResult.FAIL, f"/v1/models could not be read after the wake: {exc}")
        problems: list[str] = []
        lost: dict[str, AdapterMark] = {}
        for name, mark in sorted(before.items()):
            problem = await self._adapter_problem(name, mark, listed, base=self._last_answer)
            if problem is not None:
                problems.append(problem)
                lost[name] = mark
        if problems:
            self.lost_adapters = lost
            return Check(CheckName.LORA, CheckResult.FAIL, lost_detail(problems), sorted(lost))
        answered = sum(1 for mark in before.values() if mark.golden is not None)
        detail = f"{len(before)} adapter(s) listed as before the sleep, {answered} answering as before"
        return Check(CheckName.LORA, CheckResult.PASS, detail, sorted(before))

    async def _adapter_problem(
        self, name: str, mark: AdapterMark, listed: dict[str, str | None], *, base: CanaryAnswer | None
    ) -> str | None:
        if name not in listed:
            return f"adapter {name!r} (loaded from {mark.root}) is no longer listed by /v1/models"
        if mark.golden is None:
            return None
        try:
            answer = await self._canary(model=name, tokens=mark.tokens)
        except (UpstreamError, ValueError, KeyError, TypeError, IndexError) as exc:
            return f"adapter {name!r}: its canary completion failed: {exc}"
        if self._same(answer, mark.golden):
            return None
        like = " as the base model does" if base is not None and self._same(answer, base) else ""
        return (
            f"adapter {name!r} answers {answer.text!r} ({answer.logprob:.3f}){like}; "
            f"before the sleep it answered {mark.golden.text!r} ({mark.golden.logprob:.3f})"
        )

    async def recheck_adapters(self) -> Check:
        """FAILED for lost adapters: healed once each is unloaded, loaded again (through the proxy, or from another
        path), or answers as before the sleep again."""
        try:
            listed = await self._listed_adapters()
        except (UpstreamError, ValueError) as exc:
            return Check(CheckName.LORA, CheckResult.FAIL, f"/v1/models could not be read: {exc}")
        for name, mark in sorted(self.lost_adapters.items()):
            if self._adapters_reloaded or name not in listed or listed[name] != mark.root:
                continue
            problem = await self._adapter_problem(name, mark, listed, base=None)
            if problem is not None:
                return Check(CheckName.LORA, CheckResult.FAIL, problem, sorted(self.lost_adapters))
        self.lost_adapters = {}
        return Check(CheckName.LORA, CheckResult.PASS, "the lost adapters are loaded again or unloaded")

    def _same(self, answer: CanaryAnswer, golden: CanaryAnswer) -> bool:
        drift = abs(answer.logprob - golden.logprob)
        return answer.text == golden.text and drift <= self._settings.canary_max_logprob_drift

    def _add(self, verdict: Verdict, check: Check) -> None:
        verdict.checks.append(check)
        self._on_check(check.name, check.result)

    async def _check_flags(self, expect: Expectation, verdict: Verdict) -> Check:
        deadline = time.monotonic() + self._settings.verify_timeout_s
        late = LateReads(self._settings.late_rounds_before_failed)
        while True:
            obs = await self._client.observe()
            verdict.observation = obs
            problem = _flag_problem(obs, expect)
            # vLLM's /health is 503 only after EngineDeadError, which never clears: no use polling on.
            gone = (not obs.reachable and not obs.timed_out) or (not obs.healthy and obs.error is None)
            # A late answer is no verdict: read again, past the deadline, until too many come late in a row.
            if problem is None or gone or (time.monotonic() >= deadline and not late.pass_over(obs)):
                break
            await asyncio.sleep(self._settings.verify_poll_interval_s)
        health = Check(
            CheckName.HEALTH,
            CheckResult.PASS if obs.healthy else CheckResult.FAIL,
            "healthy" if obs.healthy else _dead(obs),
        )
        self._add(verdict, health)
        if not obs.healthy:
            return health
        flags = Check(
            CheckName.FLAGS,
            CheckResult.PASS if problem is None else CheckResult.FAIL,
            problem or "flags agree",
            {"is_sleeping": obs.sleeping, "is_paused": obs.paused},
        )
        self._add(verdict, flags)
        return flags

    async def _check_memory(self, kind: MemoryChange, before: GpuReading | None, verdict: Verdict) -> Check:
        deadline = time.monotonic() + self._settings.verify_timeout_s
        while True:
            reading = await self.read_memory()
            verdict.memory = reading
            if not reading.available:
                return Check(CheckName.MEMORY, CheckResult.UNAVAILABLE, reading.unavailable or "unavailable")
            problem = self._memory_problem(kind, reading, before)
            if problem is None:
                return Check(
                    CheckName.MEMORY, CheckResult.PASS, f"{kind}: used {_gib(reading.used_bytes)}", reading.used_bytes
                )
            if problem.startswith("unknown") or time.monotonic() >= deadline:
                result = CheckResult.UNAVAILABLE if problem.startswith("unknown") else CheckResult.FAIL
                return Check(CheckName.MEMORY, result, problem, reading.used_bytes)
            await asyncio.sleep(self._settings.verify_poll_interval_s)

    def _memory_problem(self, kind: MemoryChange, now: GpuReading, before: GpuReading | None) -> str | None:
        # Its own reading while awake; before it was seen awake (a proxy restarted beside a sleeping engine),
        # what it takes awake as configured (footprint_gib).
        footprint = self.footprint.awake_reading or self.footprint.configured
        if footprint is None and kind is MemoryChange.FREED and before is not None and before.available:
            footprint = before.used_bytes
        if not footprint:
            return "unknown: no awake footprint recorded yet"
        used = now.used_bytes
        s = self._settings
        if kind is MemoryChange.FREED:
            freed = footprint - used
            if freed < s.sleep_min_freed_fraction * footprint:
                return (
                    f"sleep freed {_gib(max(freed, 0))} of the awake {_gib(footprint)}; "
                    f"at least {s.sleep_min_freed_fraction:.0%} expected (was vLLM started with --enable-sleep-mode?)"
                )
            return None
        if kind is MemoryChange.RESTORED:
            if used < s.wake_min_restored_fraction * footprint:
                return (
                    f"wake restored only {_gib(used)} of the awake {_gib(footprint)}; "
                    f"at least {s.wake_min_restored_fraction:.0%} expected"
                )
            return None
        if before is None or not before.available:
            return "unknown: no memory reading from before the call"
        if kind is MemoryChange.PART_FREED:
            dropped = before.used_bytes - used
            if dropped < s.weights_wake_min_fraction * footprint:
                return f"releasing the KV cache freed only {_gib(max(dropped, 0))}; nothing was released"
            return None
        grown = used - before.used_bytes
        if grown < s.weights_wake_min_fraction * footprint:
            return f"the partial wake added only {_gib(max(grown, 0))}; what it woke did not come back"
        return None

    async def record_golden(self) -> None:
        """Run the canary once on an engine known to be good, so the first wake compares against a
        golden answer and pays no first-request warm-up (vLLM on CPU: ~2 s for the first logprobs)."""
        if self._settings.canary_enabled and self.golden is None:
            check = await self._check_canary()
            if check.result is not CheckResult.PASS:
                self.golden = None

    async def _check_canary(self) -> Check:
        try:
            answer = await self._canary()
        except (UpstreamError, ValueError, KeyError, TypeError, IndexError) as exc:
            return Check(CheckName.CANARY, CheckResult.FAIL, f"canary completion failed: {exc}")
        if not math.isfinite(answer.logprob):
            return Check(
                CheckName.CANARY,
                CheckResult.FAIL,
                f"non-finite logprob {answer.logprob} (garbage output)",
                answer.__dict__,
            )
        if not answer.text.strip("!") and self.golden is None:
            return Check(CheckName.CANARY, CheckResult.FAIL, f"degenerate token {answer.text!r}", answer.__dict__)
        self._last_answer = answer
        golden = self.golden
        if golden is None:
            self.golden = answer
            return Check(CheckName.CANARY, CheckResult.PASS, "recorded as golden", answer.__dict__)
        drift = abs(answer.logprob - golden.logprob)
        if answer.text != golden.text or drift > self._settings.canary_max_logprob_drift:
            return Check(
                CheckName.CANARY,
                CheckResult.FAIL,
                f"answer {answer.text!r} ({answer.logprob:.3f}) drifted from "
                f"golden {golden.text!r} ({golden.logprob:.3f})",
                answer.__dict__,
            )
        return Check(CheckName.CANARY, CheckResult.PASS, f"matches golden (logprob drift {drift:.3f})", answer.__dict__)

    def _auth(self) -> dict[str, str] | None:
        key = self._settings.upstream_api_key
        return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else None

    async def _canary(self, model: str | None = None, *, tokens: int = 1) -> CanaryAnswer:
        """The canary completion, of the base model or (`model`) of one LoRA adapter, `tokens` long (the logprob
        is the first token's)."""
        choice = await self.canary_choice(model, **({"max_tokens": tokens} if tokens != 1 else {}))
        logprob = choice["logprobs"]["token_logprobs"][0]
        return CanaryAnswer(str(choice["text"]), float("nan") if logprob is None else float(logprob))

    async def canary_choice(self, model: str | None = None, **asked: object) -> Any:
        """The canary completion's first choice; `asked`: more of the request's body (vLLM's snapshot check asks for
        `logprobs=0` and `return_token_ids`, lifecycle/checkpoint_operations.py)."""
        auth = self._auth()
        if self._model is None:
            models = (await self._client.call("GET", "/v1/models", headers=auth)).json()
            self._model = str(models["data"][0]["id"])
        payload = {
            "model": model or self._model,
            "prompt": self._settings.canary_prompt,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 1,
            **asked,
        }
        if self.cache_salt is not None:
            payload["cache_salt"] = self.cache_salt  # computed by the current weights, not from older blocks
        reply = await self._client.call(
            "POST", "/v1/completions", json_body=payload, timeout_s=self._settings.canary_timeout_s, headers=auth
        )
        if reply.status != 200:
            raise ValueError(f"status {reply.status}: {reply.message()}")
        return reply.json()["choices"][0]


def _flag_problem(obs: Observation, expect: Expectation) -> str | None:
    if not obs.reachable or not obs.healthy:
        return _dead(obs)
    if obs.sleeping is not None and obs.sleeping != expect.sleeping:
        return f"/is_sleeping is {str(obs.sleeping).lower()}, expected {str(expect.sleeping).lower()}"
    if expect.paused is not None and obs.paused is not None and obs.paused != expect.paused:
        return f"/is_paused is {str(obs.paused).lower()}, expected {str(expect.paused).lower()}"
    return None


def _dead(obs: Observation) -> str:
    return "engine unreachable" + (f": {obs.error}" if obs.error else "") if not obs.reachable else "/health is not 200"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def lost_detail(problems: Iterable[str]) -> str:
    """What a client is told of adapters found lost, and the way back."""
    return "; ".join(problems) + " (vLLM #53888); load it again (/v1/load_lora_adapter) or unload it"
