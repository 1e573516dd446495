"""A thin client for the vLLM HTTP surface the conformance scenarios exercise.

It only speaks HTTP, so the same scenarios run against the simulator or a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Long enough that a sleep or pause sent at the first token lands mid-stream on real vLLM (~300 tokens/s
# here, max-model-len 16384), where the client can see that first token seconds late (a starved API server);
# 400 and then 3000 tokens sometimes finished first.
LONG_STREAM_TOKENS = 12000


@dataclass
class Answer:
    status: int
    body: Any
    text: str


@dataclass
class StreamResult:
    """What a streaming completion delivered; ``first_text`` is set once the first token arrived."""

    status: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    first_text: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.get("choices") and _chunk_text(c))

    @property
    def finish_reason(self) -> str | None:
        reasons = [ch.get("finish_reason") for c in self.chunks for ch in c.get("choices", [])]
        found = [r for r in reasons if r]
        return found[-1] if found else None


def _chunk_text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    if "text" in choice:
        return str(choice["text"] or "")
    return str((choice.get("delta") or {}).get("content") or "")


class VllmApi:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.model = model

    async def call(
        self, method: str, path: str, *, params: Any = None, json_body: Any = None, data: bytes | None = None
    ) -> Answer:
        async with self.session.request(method, self.base + path, params=params, json=json_body, data=data) as resp:
            text = await resp.text()
            try:
                body = json.loads(text) if text else None
            except ValueError:
                body = None
            return Answer(resp.status, body, text)

    async def post(self, path: str, **params: Any) -> Answer:
        return await self.call("POST", path, params=params or None)

    async def get(self, path: str) -> Answer:
        return await self.call("GET", path)

    async def is_sleeping(self) -> bool:
        return bool((await self.get("/is_sleeping")).body["is_sleeping"])

    async def is_paused(self) -> bool:
        return bool((await self.get("/is_paused")).body["is_paused"])

    async def sleep(self, level: int = 1, mode: str | None = None) -> Answer:
        params: dict[str, Any] = {"level": level}
        if mode:
            params["mode"] = mode
        return await self.call("POST", "/sleep", params=params)

    async def wake(self, *tags: str) -> Answer:
        return await self.call("POST", "/wake_up", params=[("tags", t) for t in tags] or None)

    async def completion(self, prompt: str = "Count upward slowly:", max_tokens: int = 8, **extra: Any) -> Answer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return await self.call("POST", "/v1/completions", json_body=body)

    async def stream_completion(
        self, result: StreamResult, *, max_tokens: int = LONG_STREAM_TOKENS, **extra: Any
    ) -> StreamResult:
        body = {
            "model": self.model,
            "prompt": "Count upward slowly: one, two, three,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            **extra,
        }
        async with self.session.post(self.base + "/v1/completions", json=body) as resp:
            result.status = resp.status
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(payload)
                result.chunks.append(chunk)
                if chunk.get("choices") and _chunk_text(chunk):
                    result.first_text.set()
                # Let the test run: aiohttp's readline returns without suspending while lines are buffered,
                # so a reader slower than vLLM (two busy cores) kept the loop until the stream ended.
                await asyncio.sleep(0)
        return result

    async def server_load(self) -> int:
        return int((await self.get("/load")).body["server_load"])

    async def sleep_state_metric(self) -> tuple[float, float, float]:
        text = (await self.get("/metrics")).text
        values = {}
        for label in ("awake", "weights_offloaded", "discard_all"):
            match = re.search(rf'vllm:engine_sleep_state\{{[^}}]*sleep_state="{label}"[^}}]*\}} (\S+)', text)
            assert match, f"engine_sleep_state{{sleep_state={label}}} missing from /metrics"
            values[label] = float(match.group(1))
        return values["awake"], values["weights_offloaded"], values["discard_all"]

    async def metric_sum(self, name: str, **labels: str) -> float:
        text = (await self.get("/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``check`` until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.01)


async def engine_holds_one(vllm: VllmApi) -> None:
    """Wait until the engine holds a request: GET /load counts one."""

    async def held() -> bool:
        return await vllm.server_load() >= 1

    await eventually(held, what="the engine to hold the request (GET /load)")


async def settled_chunks(result: StreamResult, quiet_s: float = 0.5, timeout: float = 15.0) -> int:
    """The text-chunk count once none came for ``quiet_s``: a real vLLM short of CPU delivers tokens made
    before a freeze in late bursts, which are not progress made while frozen."""
    deadline = time.monotonic() + timeout
    count, since = result.text_chunks, time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling the reader's count, not standing in for an event
        if result.text_chunks != count:
            count, since = result.text_chunks, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return count
    raise AssertionError(f"the stream never went quiet ({count} text chunks)")


async def still_pending(task: asyncio.Task[Any], window: float = 0.3) -> bool:
    """True when ``task`` has not finished within ``window``: a negative check, not synchronisation."""
    done, _ = await asyncio.wait({task}, timeout=window)
    return not done
