"""One column of the matrix: the URL a client sends to (vLLM itself, or the lifeguard in front of it), what
each row sent there and got back, the engine's state after a row, and bringing the engine back between rows."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..gpu.readers import GpuMemoryReader
from ..lifecycle.prefix_cache import reset_result
from .client import Http, Reply
from .target import busy

#: The canary: a short greedy completion whose answer must not change across a cycle that keeps the weights.
CANARY_PROMPT = "The capital of France is"
#: How long a request may stay unanswered before a row calls it held (through) or hung (direct).
PENDING_WINDOW_S = 2.0
#: The deadline of a request a row leaves waiting while the engine sleeps, and of restoring the engine.
WAIT_DEADLINE_S = 30.0
#: The tokens of a stream a row pauses mid-way: seconds long on vLLM-for-CPU's tiny model (it streams 600 in about a
#: second, and a loaded machine sees the first of them late).
STREAM_TOKENS = 3000


@dataclass
class Column:
    """``name`` is "direct" or "through"; ``lifeguard`` tells whether ``http`` is a lifeguard."""

    name: str
    http: Http
    lifeguard: bool
    model: str
    gpu: GpuMemoryReader
    lora_adapters: list[str] = field(default_factory=list)
    golden: str | None = None
    steps: list[Reply] = field(default_factory=list)
    pending_window_s: float = PENDING_WINDOW_S
    stream_tokens: int = STREAM_TOKENS
    restore_deadline_s: float = WAIT_DEADLINE_S

    async def call(self, method: str, path: str, **kwargs: Any) -> Reply:
        reply = await self.http.call(method, path, **kwargs)
        self.steps.append(reply)
        return reply

    async def post(self, path: str, **params: str) -> Reply:
        return await self.call("POST", path, params=params or None)

    async def sleep(self, level: int, mode: str | None = None) -> Reply:
        params = {"level": str(level), **({"mode": mode} if mode else {})}
        return await self.call("POST", "/sleep", params=params)

    async def wake(self, *tags: str) -> Reply:
        return await self.call("POST", "/wake_up", params=[("tags", t) for t in tags] or None)

    async def rpc(self, method: str) -> Reply:
        return await self.call("POST", "/collective_rpc", json_body={"method": method})

    async def completion(
        self,
        *,
        model: str | None = None,
        prompt: str = CANARY_PROMPT,
        timeout: float = WAIT_DEADLINE_S,
        cache_salt: str | None = None,
    ) -> Reply:
        body: dict[str, object] = {"model": model or self.model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                   "ignore_eos": True}  # fmt: skip
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return await self.call("POST", "/v1/completions", json_body=body, timeout=timeout)

    async def canary(self, model: str | None = None) -> Reply:
        """The canary, salted afresh: its answer comes from the weights, never from a prefix-cache block other
        weights computed (a row that wrote weights leaves the canary's block cached, and the old answer with it)."""
        return await self.completion(model=model, cache_salt=f"lifeguard-check-{secrets.token_hex(8)}")

    def later(self, reply: Awaitable[Reply]) -> asyncio.Task[Reply]:
        """A request left waiting while the row goes on; the row awaits it (it has its own deadline)."""
        return asyncio.ensure_future(reply)

    async def flags(self) -> dict[str, Any]:
        """The engine's flags and health as vLLM reports them, and the lifeguard's state where there is one;
        reads are not steps of the row."""
        sleeping, paused, health = await asyncio.gather(
            self.http.get("/is_sleeping", timeout=10),
            self.http.get("/is_paused", timeout=10),
            self.http.get("/health", timeout=10),
        )
        state: dict[str, Any] = {
            "is_sleeping": _flag(sleeping, "is_sleeping"),
            "is_paused": _flag(paused, "is_paused"),
            "health": health.status if health.status is not None else health.failure,
        }
        if self.lifeguard:
            body = await self.lifeguard_state()
            state["lifeguard"] = body.get("state")
            state["held_requests"] = body.get("held_requests")
        return state

    async def held(self) -> int:
        """Requests the lifeguard holds now (0 for vLLM itself, which holds nothing it tells about)."""
        if not self.lifeguard:
            return 0
        return int((await self.lifeguard_state()).get("held_requests") or 0)

    async def answer_text(self, model: str | None = None) -> str | None:
        return completion_text(await self.canary(model))

    async def restore(self) -> str | None:
        """Back to awake, unpaused, idle and answering the golden canary; None when it is, else why not."""
        if why := await self.lost():
            return why
        # Only what is needed: a wake or resume the engine does not need is a call a lie may answer (a fault
        # armed for the next wake is the row's to meet, not this restore's).
        if (await self.flags())["is_sleeping"]:
            await self.wake()
        if (await self.flags())["is_paused"]:
            await self.post("/resume")
        if self.lifeguard and (await self.lifeguard_state()).get("weights_stale"):
            await self.rpc("reload_weights")  # the lifeguard holds inference until the weights are loaded again
        reset_due = False
        if self.golden is not None and await self.answer_text() != self.golden:
            # A level-2 sleep discarded the weights, or a row wrote new ones: load the checkpoint again, as a
            # trainer would, and drop the prefix cache, whose blocks the other weights computed (class 21).
            await self.rpc("reload_weights")
            reset_due = True
        deadline = time.monotonic() + self.restore_deadline_s
        while True:
            state = await self.flags()
            why = await busy(self.http, "lifeguard" if self.lifeguard else "vllm")
            idle = not state["is_sleeping"] and not state["is_paused"] and state["health"] == 200 and why is None
            if idle and reset_due:
                # Once idle: vLLM resets only while no request holds blocks, and another client's request (the
                # lifeguard's own canary, behind the direct column) may have held some a moment ago.
                reset_due = not await self._prefix_cache_reset()
            if idle and not reset_due:
                break
            if (lost := await self.lost()) or time.monotonic() > deadline:
                left = why or ("its prefix cache could not be reset" if reset_due else state)
                return lost or f"the engine did not come back within {self.restore_deadline_s:g} s: {left}"
            await asyncio.sleep(0.1)  # polling the engine's flags, with the deadline above
        if self.golden is not None and (now := await self.answer_text()) != self.golden:
            return f"the engine answers the canary {now!r}, not {self.golden!r} as before"
        return None

    async def _prefix_cache_reset(self) -> bool:
        """True unless vLLM answered 200 `{"success": false}` (blocks still held: try again)."""
        return prefix_cache_reset_said(await self.post("/reset_prefix_cache")) is not False

    async def lost(self) -> str | None:
        """Why the engine cannot be brought back by the check (dead, or failed in the lifeguard), or None."""
        health = await self.http.get("/health", timeout=10)
        if health.status is None or health.status >= 500:
            return f"the engine is gone (/health: {health.summary()[:80]})"
        if self.lifeguard and (state := await self.lifeguard_state()).get("state") == "FAILED":
            return f"the lifeguard failed the engine ({state.get('failure')}): it needs an operator"
        return None

    async def lifeguard_state(self) -> dict[str, Any]:
        body = (await self.http.get("/lifeguard/state", timeout=10)).body
        return body if isinstance(body, dict) else {}


def completion_text(reply: Reply) -> str | None:
    if reply.status != 200 or not isinstance(reply.body, dict):
        return None
    choices = reply.body.get("choices") or [{}]
    text = choices[0].get("text")
    return None if text is None else str(text)


def _flag(reply: Reply, name: str) -> bool | None:
    return bool(reply.body[name]) if isinstance(reply.body, dict) and name in reply.body else None


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float, unless: Callable[[], bool] | None = None
) -> bool:
    """Poll ``check`` until it holds (True), or ``timeout`` passes or ``unless`` holds (False)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline or (unless is not None and unless()):
            return False
        await asyncio.sleep(0.05)
    return True


def prefix_cache_reset_said(reply: Reply) -> bool | None:
    """What a `/reset_prefix_cache` reply says, by the proxy's one rule for it (`prefix_cache.reset_result`): True
    (emptied), False (200 `{"success": false}`: blocks still held), None (nothing came back, or it does not say)."""
    return None if reply.status is None else reset_result(reply.status, reply.text.encode())
