"""Helpers shared by the real-vLLM tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest

from tests.lifeguard_testing import stream_under_way

MODEL = "tiny"  # --served-model-name of the session's vLLM
# max_tokens of a "long" stream: ~35 s at the ~300-370 tokens/s the tiny model makes on its core (max-model-len
# 16384). Tests pause, sleep or kill mid-stream. vLLM binds its worker to core 0 and leaves the API server, the
# proxy and the tests to share core 1: the client can see the first chunk several seconds late (8.8 s measured
# with a busy core), so 480 and then 3000 tokens sometimes ended before the pause landed.
LONG = 12000

T = TypeVar("T")
Samples = list[tuple[str, dict[str, str], float]]


async def wait_until(
    probe: Callable[[], Awaitable[T]],
    pred: Callable[[T], bool],
    timeout: float = 15.0,
    what: str = "condition",
    interval: float = 0.02,
) -> T:
    """Poll ``probe()`` until ``pred(value)`` holds; fail with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if pred(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}; last value: {value!r}")
        await asyncio.sleep(interval)


async def get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        assert r.status == 200, f"GET {url} -> {r.status} {await r.text()}"
        return await r.json(content_type=None)


async def post(s: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any, Any]:
    """POST; return (status, JSON body / raw text / None when empty, headers)."""
    async with s.post(url, **kw) as r:
        raw = await r.read()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        return r.status, body, r.headers


async def lg_state(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """The proxy's ``GET /lifeguard/state``."""
    state: dict[str, Any] = await get_json(s, base + "/lifeguard/state")
    return state


async def wait_state(s: aiohttp.ClientSession, base: str, want: str, timeout: float = 15.0) -> dict[str, Any]:
    return await wait_until(
        lambda: lg_state(s, base), lambda st: st["state"] == want, timeout, what=f"proxy state {want}"
    )


async def wait_held(s: aiohttp.ClientSession, base: str, n: int, timeout: float = 15.0) -> dict[str, Any]:
    return await wait_until(
        lambda: lg_state(s, base), lambda st: st["held_requests"] == n, timeout, what=f"{n} held request(s)"
    )


async def vllm_flags(s: aiohttp.ClientSession, vllm: str) -> tuple[bool, bool, int]:
    """(is_sleeping, is_paused, server_load) read from vLLM directly."""
    sl = await get_json(s, vllm + "/is_sleeping")
    pa = await get_json(s, vllm + "/is_paused")
    lo = await get_json(s, vllm + "/load")
    return sl["is_sleeping"], pa["is_paused"], lo["server_load"]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> Samples:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def has_metric(samples: Samples, name: str, **labels: str) -> bool:
    return any(n == name and all(lab.get(k) == x for k, x in labels.items()) for n, lab, _ in samples)


async def metrics(s: aiohttp.ClientSession, base: str) -> Samples:
    async with s.get(base + "/metrics") as r:
        assert r.status == 200, r.status
        return parse_metrics(await r.text())


def sleep_ops(samples: Samples, op: str = "sleep") -> float:
    """How many /sleep (or wake, ...) calls vLLM has served."""
    return metric(samples, "vllm:sleep_mode_operation_duration_seconds_count", operation=op)


def weight_ops(samples: Samples, op: str) -> float:
    return metric(samples, "vllm:rl_weight_update_operation_duration_seconds_count", operation=op)


def engine_requests(samples: Samples) -> float:
    return metric(samples, "vllm:num_requests_running") + metric(samples, "vllm:num_requests_waiting")


def sleep_state(samples: Samples) -> tuple[float, float, float]:
    """vllm:engine_sleep_state as (awake, weights_offloaded, discard_all), as vLLM's test reads it."""
    vals = []
    for label in ("awake", "weights_offloaded", "discard_all"):
        assert has_metric(samples, "vllm:engine_sleep_state", sleep_state=label), label
        vals.append(metric(samples, "vllm:engine_sleep_state", sleep_state=label))
    return vals[0], vals[1], vals[2]


def assert_proxy_error(status: int, body: Any, headers: Any, expect: int) -> dict[str, Any]:
    """The proxy's own errors: OpenAI-shaped JSON plus X-Lifeguard-Reason (and Retry-After on 503)."""
    assert status == expect, f"expected {expect}, got {status}: {body!r}"
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err: dict[str, Any] = body["error"]
    for key in ("message", "type", "param", "code"):
        assert key in err, body
    assert headers.get("X-Lifeguard-Reason"), dict(headers)
    if expect == 503:
        assert headers.get("Retry-After"), dict(headers)
    return err


async def engine_never_saw_it(s: aiohttp.ClientSession, vllm: str) -> None:
    """vLLM has no request: /load (with --enable-server-load-tracking) and num_requests_* are 0."""
    load = await get_json(s, vllm + "/load")
    assert load == {"server_load": 0}, load
    assert engine_requests(await metrics(s, vllm)) == 0


async def under_way(s: aiohttp.ClientSession, vllm: str, stream: StreamReader) -> None:
    """A long stream has reached vLLM (lifeguard_testing.stream_under_way); its /load can answer late too."""
    counted = wait_until(lambda: get_json(s, vllm + "/load"), lambda load: load["server_load"] >= 1, 30, "vLLM's /load")
    await stream_under_way(counted, stream.started, load="vLLM's /load", detail=stream.timing)


#: The rollout of the trainer-client tests (test_vllm_clients.py, test_vllm_skyrl_0_4.py): greedy, so that an answer
#: through the proxy compares with vLLM's own.
PROMPT_IDS = [1, 45, 74]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}


def skyrl_client(skyrl: Any, url: str) -> Any:
    """SkyRL's `RemoteInferenceClient` (from the module `skyrl`) for the one server at `url`."""
    return skyrl.RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=MODEL)


async def skyrl_rollout(engine_client: Any, max_tokens: int = 8) -> dict[str, Any]:
    """A greedy rollout of PROMPT_IDS through SkyRL's `generate`, all `max_tokens` of it."""
    batch = {"prompt_token_ids": [PROMPT_IDS], "sampling_params": {**GREEDY, "max_tokens": max_tokens}}
    output = await engine_client.generate(batch)
    assert len(output["response_ids"][0]) == max_tokens, output
    return dict(output)


class StreamReader:
    """Reads an OpenAI SSE stream with aiohttp, recording every data event as it arrives."""

    def __init__(self) -> None:
        self.events: list[Any] = []  # parsed JSON of each `data:` line ("[DONE]" kept as the string)
        self.status: int | None = None
        self.started = asyncio.Event()  # set at the first choice chunk
        self.sent_at: float | None = None  # monotonic: request sent, headers in, first choice chunk
        self.headers_at: float | None = None
        self.first_chunk_at: float | None = None
        self.noticed_at: float | None = None  # set by a test when it saw `started`

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and e.get("choices")]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks]
        reasons = [r for r in reasons if r]
        return reasons[-1] if reasons else None

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            ch = c["choices"][0]
            out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def completion_tokens(self) -> int | None:
        """From the usage chunk (``stream_options.include_usage``): vLLM may pack several tokens into
        one chunk when the reader lags, so counting chunks undercounts."""
        usages = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        return int(usages[-1]["completion_tokens"]) if usages else None

    @property
    def errors(self) -> list[Any]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    def _record(self, raw: bytes) -> None:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        event = data if data == "[DONE]" else json.loads(data)
        self.events.append(event)
        if not self.started.is_set() and isinstance(event, dict) and event.get("choices"):
            self.first_chunk_at = time.monotonic()
            self.started.set()

    def timing(self) -> str:
        """For failure messages: when the stream's milestones came, relative to sending it."""
        t0 = self.sent_at or 0.0
        marks = {"headers": self.headers_at, "first chunk": self.first_chunk_at, "noticed": self.noticed_at}
        shown = ", ".join(f"{k} +{v - t0:.3f} s" for k, v in marks.items() if v is not None)
        return f"{shown or 'nothing received'}; {len(self.chunks)} chunks, finish {self.finish_reason}"

    async def run(
        self, s: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None
    ) -> StreamReader:
        """Read the stream to its end; `timeout`: the request's own deadline, where the session's is too short."""
        self.sent_at = time.monotonic()
        async with s.post(url, json=body, timeout=timeout or s.timeout) as r:
            self.headers_at = time.monotonic()
            self.status = r.status
            if r.status != 200:
                self.events.append(await r.json(content_type=None))
                return self
            pending = b""
            async for data in r.content.iter_any():
                # Whatever is buffered at once, split here: a line at a time with a loop turn each (as before) took
                # thousands of turns to work through a backlog, and the test's own calls waited behind them.
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for raw in lines:
                    self._record(raw)
                await asyncio.sleep(0)  # iter_any returns buffered data without suspending: let the test run
            self._record(pending)
        return self


def long_stream_body(max_tokens: int = LONG) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "Count upward slowly: one, two, three,",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def short_completion_body(max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello world", "max_tokens": max_tokens, "temperature": 0}
