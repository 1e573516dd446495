"""What the rows of the matrix (proxy/check/matrix.py) do: each one hazard of vLLM's lifecycle, run against one
`Column` (vLLM itself, or the lifeguard in front of it) with the same code, judging what a client saw: red where it
was misled (a 200 that is not true, a request hung with no deadline, a crash), green where it was told the truth. A
row leaves the engine as it found it or says it could not (the runner then restores it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .client import Reply
from .column import WAIT_DEADLINE_S, Column, completion_text, eventually, prefix_cache_reset_said
from .target import metric_sum

GREEN, RED, SKIP = "green", "red", "skip"


@dataclass(frozen=True)
class Finding:
    verdict: str  # green, red or skip
    why: str


def green(why: str) -> Finding:
    return Finding(GREEN, why)


def red(why: str) -> Finding:
    return Finding(RED, why)


def skip(why: str) -> Finding:
    return Finding(SKIP, why)


async def _untrue(col: Column, reply: Reply, *, sleeping: bool | None = None, paused: bool | None = None) -> str | None:
    """Why a 200 is not true: the flags or /health disagree with what it claimed; None when they agree."""
    state = await col.flags()
    if state["health"] != 200:
        return f"{reply.method} {reply.path} answered 200, then /health answered {state['health']}"
    for flag, expected in (("is_sleeping", sleeping), ("is_paused", paused)):
        if expected is not None and state[flag] != expected:
            return f"{reply.method} {reply.path} answered 200 but /{flag} is {str(state[flag]).lower()}"
    return None


async def _sent_while_asleep(col: Column) -> tuple[asyncio.Task[Reply], bool, int]:
    """A completion sent now: its task, whether it was answered within the pending window, and if not, how many
    requests the lifeguard says it holds (0 for vLLM itself)."""
    pending = col.later(col.canary())
    done, _ = await asyncio.wait({pending}, timeout=col.pending_window_s)
    held = await col.held() if not done else 0
    return pending, bool(done), held


def _refused(reply: Reply) -> bool:
    return reply.status is not None and 400 <= reply.status < 600


# ---------------------------------------------------------------- sleep and wake
def sleep_wake(level: int) -> Callable[[Column], Awaitable[Finding]]:
    async def run(col: Column) -> Finding:
        slept = await col.sleep(level)
        if slept.status != 200:
            return green(f"the sleep answered {slept.summary()}: the client knows it did not sleep")
        if why := await _untrue(col, slept, sleeping=True):
            return red(why)
        if level == 2:  # the documented order: weights, their reload, then the KV cache
            for step in (col.wake("weights"), col.rpc("reload_weights"), col.wake("kv_cache")):
                if (reply := await step).status != 200:
                    return green(f"{reply.method} {reply.path} answered {reply.summary()}: the client was told")
            woke = col.steps[-1]
        else:
            woke = await col.wake()
            if woke.status != 200:
                return green(f"the wake answered {woke.summary()}: the client was told it failed")
        if why := await _untrue(col, woke, sleeping=False):
            return red(why)
        answer = await col.answer_text()
        if answer != col.golden:
            return red(f"the wake answered 200, then the engine answered the canary {answer!r}, not {col.golden!r}")
        return green(f"slept and woke at level {level}; flags, /health and the canary agree with each 200")

    return run


async def level2_without_reload(col: Column) -> Finding:
    await col.sleep(2)
    woke = await col.wake()
    if woke.status != 200:
        return green(f"the wake answered {woke.summary()}")
    pending = col.later(col.canary())
    done, _ = await asyncio.wait({pending}, timeout=col.pending_window_s)
    if done:
        answer = completion_text(pending.result())
        if answer == col.golden:
            return green("the weights came back whole after the level-2 wake (no weights were discarded here)")
        return red(
            f"a level-2 wake without reload_weights answered 200; the engine then answered {answer!r}, "
            f"not {col.golden!r}"
        )
    held = await col.held()
    await col.rpc("reload_weights")
    answer = completion_text(await pending)
    if held and answer == col.golden:
        return green("the request was held until reload_weights, then answered as before the sleep")
    return red(f"a request after the wake waited {col.pending_window_s:g} s with nothing holding it; then {answer!r}")


async def repeated_sleep(col: Column) -> Finding:
    await col.sleep(1)
    queued = col.later(col.canary())
    await _until_waiting(col, queued)
    again = await col.sleep(1)
    noop = again.headers.get("X-Lifeguard-Noop") == "true"
    await col.wake()
    reply = await queued
    text = completion_text(reply)
    finish = _finish_reason(reply)
    if text and finish != "abort":
        signal = "answered as a no-op (X-Lifeguard-Noop)" if noop else f"answered {again.status}"
        return green(f"the repeated sleep {signal}; the request sent during the sleep was answered after the wake")
    return red(
        f"the repeated sleep answered {again.status} and the request queued during the sleep ended "
        f"{reply.summary()[:80]!r} (finish_reason {finish})"
    )


async def request_during_sleep(col: Column) -> Finding:
    await col.sleep(1)
    pending, done, held = await _sent_while_asleep(col)
    await col.wake()
    reply = await pending
    if done:
        return green(f"answered at once while asleep: {reply.summary()[:80]}")
    if held:
        return green(f"held by the lifeguard ({held} held, with its hold deadline) and answered after the wake")
    return red(
        f"no answer for {col.pending_window_s:g} s while asleep and nothing said it was held: vLLM queues it with "
        "no deadline of its own, for as long as the sleep lasts"
    )


async def wake_unknown_tag(col: Column) -> Finding:
    await col.sleep(1)
    woke = await col.wake("bogus")
    if _refused(woke):
        return green(f"the unknown tag was refused: {woke.summary()[:100]}")
    state = await col.flags()
    if woke.status == 200 and state["is_sleeping"]:
        return red("POST /wake_up?tags=bogus answered 200 and the engine is still asleep")
    return green(f"answered {woke.summary()[:80]}; /is_sleeping {state['is_sleeping']}")


async def wake_comma_tags(col: Column) -> Finding:
    await col.sleep(1)
    woke = await col.call("POST", "/wake_up", params={"tags": "weights,kv_cache"})
    if _refused(woke):
        return green(f"refused: {woke.summary()[:100]}")
    if why := await _untrue(col, woke, sleeping=False):
        return red(why + " (the comma-joined tags woke nothing)")
    return green("the comma-joined tags woke the engine, as the client asked")


async def partial_wake_then_forward(col: Column) -> Finding:
    await col.sleep(1)
    woke = await col.wake("weights")
    pending, done, held = await _sent_while_asleep(col)
    await col.wake("kv_cache")
    reply = await pending
    if done:
        return green(f"the request after the partial wake was answered at once: {reply.summary()[:80]}")
    if held:
        return green("the weights-only wake kept the engine SLEEPING; the request was held, then answered")
    return red(
        f"the weights-only wake answered {woke.status}; a request then got no answer for "
        f"{col.pending_window_s:g} s, with nothing saying it is held"
    )


async def resume_while_asleep(col: Column) -> Finding:
    await col.sleep(1)
    resumed = await col.post("/resume")
    if _refused(resumed):
        return green(f"refused: {resumed.summary()[:100]}")
    state = await col.flags()
    if resumed.status == 200 and state["is_sleeping"]:
        return red(
            "POST /resume answered 200 while the engine's memory sleeps: vLLM un-pauses the scheduler "
            "onto memory that is not mapped"
        )
    return green(f"answered {resumed.summary()[:60]}; /is_sleeping {state['is_sleeping']}")


async def wake_lifts_pause(col: Column) -> Finding:
    await col.post("/pause", mode="keep")
    woke = await col.wake()
    state = await col.flags()
    if woke.status == 200 and state["is_paused"] is False:
        return red("POST /wake_up on a paused, awake engine answered 200 and lifted the trainer's pause")
    return green(f"the wake answered {woke.summary()[:60]}; the pause stands (/is_paused {state['is_paused']})")


def pause_mode(mode: str) -> Callable[[Column], Awaitable[Finding]]:
    async def run(col: Column) -> Finding:
        signals = []
        for _ in range(2):
            paused = await col.post("/pause", mode=mode)
            if paused.status != 200:
                return green(f"the pause answered {paused.summary()[:80]}")
            if why := await _untrue(col, paused, paused=True):
                return red(why)
            signals.append(paused.headers.get("X-Lifeguard-Noop") == "true")
        resumed = await col.post("/resume")
        if why := await _untrue(col, resumed, paused=False):
            return red(why)
        if await col.answer_text() != col.golden:
            return red("after the pause and resume the canary's answer changed")
        noop = "the second marked X-Lifeguard-Noop" if signals[1] else "no signal that the second did nothing"
        return green(f"pause (mode={mode}) twice and resume: each 200 true; {noop}")

    return run


async def second_resume(col: Column) -> Finding:
    await col.sleep(1)
    await col.wake()
    resumed = await col.post("/resume")
    if resumed.headers.get("X-Lifeguard-Noop") == "true" or _refused(resumed):
        return green("the /resume after the wake never reached vLLM (answered as a no-op)")
    return red(
        "a /resume after the wake (which already resumed) reached vLLM and answered 200: on data-parallel "
        "ranks this deadlocks (verl #7846)"
    )


# ---------------------------------------------------------------- the weight-update protocol
def out_of_order(path: str, body: dict[str, object]) -> Callable[[Column], Awaitable[Finding]]:
    async def run(col: Column) -> Finding:
        reply = await col.call("POST", path, json_body=body)
        if reply.status == 200:
            return red(f"POST {path} out of order answered 200")
        return green(f"refused: {reply.summary()[:100]}")

    return run


async def start_twice(col: Column) -> Finding:
    first = await col.post("/start_weight_update")
    if first.status != 200:
        return skip(f"no weight transfer here: /start_weight_update answered {first.summary()[:100]}")
    second = await col.post("/start_weight_update")
    await col.call("POST", "/finish_weight_update", json_body={})
    if second.status == 200:
        return red("a second /start_weight_update with a session open answered 200")
    return green(f"the second start was refused: {second.summary()[:100]}")


async def weight_update_in_order(col: Column) -> Finding:
    init = await col.call("POST", "/init_weight_transfer_engine", json_body={"init_info": {}})
    if init.status != 200:
        return skip(f"no weight transfer here: /init_weight_transfer_engine answered {init.summary()[:100]}")
    version = "lifeguard-check"
    for path, body in (
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {}}),
        ("/finish_weight_update", {"weight_version": version}),
    ):
        if (reply := await col.call("POST", path, json_body=body)).status != 200:
            return red(f"POST {path} in order answered {reply.summary()[:100]}")
    info = await col.call("GET", "/weight_info")
    found = info.body.get("weight_version") if isinstance(info.body, dict) else None
    if found != version:
        return red(f"the update finished 200 but /weight_info says {found!r}, not {version!r}")
    return green("init, start, update, finish answered 200 and /weight_info reports the new version")


async def weight_update_while_asleep(col: Column) -> Finding:
    await col.sleep(1)
    started = await col.post("/start_weight_update")
    if started.status == 200:
        await col.call("POST", "/finish_weight_update", json_body={})
        return red(
            "/start_weight_update answered 200 while the weights sleep: an update then writes into memory "
            "that is not mapped (vLLM #57853: it never returns, the engine core dies)"
        )
    return green(f"refused: {started.summary()[:100]}")


# ---------------------------------------------------------------- the prefix cache after a weight change
async def prefix_cache_after_weight_change(col: Column) -> Finding:
    """The fully-async weight sync of SkyRL 0.4 and TRL: a request kept by the pause holds blocks, so the reset
    fails (class 21, vLLM #46893)."""
    await col.completion(prompt=CACHED_PROMPT)
    # Running once its first event came (vLLM's running gauge read 0 through a whole 15 s stream at times on
    # vLLM-for-CPU 0.32, after a sleep and wake the CPU worker ignores).
    began = asyncio.Event()
    body = _long_stream_body(col.model)
    stream = col.later(col.call("POST", "/v1/completions", json_body=body, timeout=120, first_bytes=began))

    async def running() -> bool:
        return (began.is_set() or await vllm_running(col)) and not stream.done()

    if not await eventually(running, timeout=WAIT_DEADLINE_S, unless=stream.done):
        stream.cancel()
        ended = (
            f": it ended first ({stream.result().summary()[:100]})" if stream.done() and not stream.cancelled() else ""
        )
        return skip(f"no request could be kept running to hold cache blocks{ended}")
    try:
        await col.post("/pause", mode="keep", clear_cache="false")
        reload = await col.rpc("reload_weights")
        reset = await col.post("/reset_prefix_cache")
        kept = not stream.done()  # the pause froze it: it held its blocks through the reset
        await col.post("/resume")
    finally:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    if reload.status != 200:
        return skip(f"the weights could not be reloaded here: {reload.summary()[:100]}")
    if not kept:
        return skip(f"the request meant to be kept ended before the reset ({stream.result().summary()[:80]})")
    partition = reset.headers.get("X-Lifeguard-Prefix-Cache")
    if partition in ("partitioned", "clean"):
        return green(
            f"the reset answered {reset.summary()[:60]} with X-Lifeguard-Prefix-Cache: {partition}: "
            "no later request is served from blocks of the old weights"
        )
    if prefix_cache_reset_said(reset) is False:
        return red(
            'after the weight change /reset_prefix_cache answered 200 {"success": false} (a kept request '
            "holds blocks): later requests with a cached prefix run on KV of the old weights"
        )
    return green(f"the reset answered {reset.summary()[:80]}")


CACHED_PROMPT = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 20


async def checkpoint_cycle(col: Column) -> Finding:
    """vLLM 0.34's process checkpoint: a request and a `/sleep` while prepared, then the restore."""
    prepared = await col.post("/checkpoint/prepare", mode="abort")
    if prepared.status == 404:
        return skip("no /checkpoint/prepare here (vLLM before 0.34, or sleep mode off)")
    if prepared.status != 200:
        return green(f"the prepare answered {prepared.summary()[:80]}: the client knows it did not happen")
    pending, done, held = await _sent_while_asleep(col)
    slept = await col.sleep(1)
    restored = await col.post("/checkpoint/restore")
    reply = await pending
    if done and reply.status != 200:
        return red(
            f"a request sent while prepared was answered {reply.summary()[:80]}: a retryable refusal each client must "
            "retry by itself, while /health says 200"
        )
    if slept.status is not None and slept.status >= 500:
        return red(f"/sleep on a prepared engine answered {slept.summary()[:80]}: an internal error, not a refusal")
    if restored.status != 200 or reply.status != 200:
        return red(f"the restore answered {restored.summary()[:60]}; the request sent meanwhile {reply.summary()[:60]}")
    how = f"held ({held}) and " if held else ""
    return green(f"the request sent while prepared was {how}answered after the restore; /sleep: {slept.summary()[:60]}")


def _long_stream_body(model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": "Count upward slowly:",
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


# ---------------------------------------------------------------- LoRA across a wake
async def lora_across_wake(col: Column) -> Finding:
    if not col.lora_adapters:
        return skip("no LoRA adapter is loaded (load one, or pass --lora NAME=PATH)")
    adapter = col.lora_adapters[0]
    before = await col.answer_text(model=adapter)
    await col.sleep(1)
    woke = await col.wake()
    if woke.status != 200:
        return green(f"the wake answered {woke.summary()[:120]}")
    after = await col.answer_text(model=adapter)
    if after != before:
        return red(
            f"the wake answered 200, then adapter {adapter!r} answered {after!r}, not {before!r} as before "
            "the sleep (its weights were lost, vLLM #53888)"
        )
    return green(f"adapter {adapter!r} answers after the wake as before the sleep")


async def _until_waiting(col: Column, task: asyncio.Task[Reply]) -> None:
    """Until the request is queued by vLLM or held by the lifeguard (bounded: it may already have been answered)."""

    async def seen() -> bool:
        return task.done() or await col.held() > 0 or await _waiting(col) > 0

    # Returns as soon as it is seen: a deadline longer than the hang window costs nothing, and a loaded engine's
    # /metrics may count the request late (sent too early, the second sleep would miss it).
    await eventually(seen, timeout=WAIT_DEADLINE_S / 3)


async def _waiting(col: Column) -> float:
    text = (await col.http.get("/metrics", timeout=10)).text
    return metric_sum(text, "vllm:num_requests_waiting") + metric_sum(text, "vllm:num_requests_running")


async def vllm_running(col: Column) -> bool:
    text = (await col.http.get("/metrics", timeout=10)).text
    return metric_sum(text, "vllm:num_requests_running") > 0


def _finish_reason(reply: Reply) -> str | None:
    if not isinstance(reply.body, dict):
        return None
    choices = reply.body.get("choices") or [{}]
    reason = choices[0].get("finish_reason")
    return None if reason is None else str(reason)


# ---------------------------------------------------------------- physical: GPU memory
#: A level-1 sleep must free at least this share of what the device used awake, and a wake give back this much.
SLEEP_FREES_FRACTION = 0.5
WAKE_RESTORES_FRACTION = 0.9
GIB = float(1 << 30)


async def memory_follows_sleep(col: Column) -> Finding:
    awake = await col.gpu.read()
    if not awake.available:
        return skip(f"no GPU memory to read here: {awake.unavailable}")
    slept = await col.sleep(1)
    asleep = await col.gpu.read()
    woke = await col.wake()
    back = await col.gpu.read()
    used = [awake.used_bytes / GIB, asleep.used_bytes / GIB, back.used_bytes / GIB]
    figures = f"{used[0]:.2f} → {used[1]:.2f} → {used[2]:.2f} GiB"
    if slept.status == 200 and used[1] > used[0] * (1 - SLEEP_FREES_FRACTION):
        return red(f"the sleep answered 200 but the GPU memory did not fall ({figures})")
    if woke.status == 200 and slept.status == 200 and used[2] < used[0] * WAKE_RESTORES_FRACTION:
        return red(f"the wake answered 200 but the GPU memory did not come back ({figures})")
    if slept.status != 200 or woke.status != 200:
        return green(f"the sleep answered {slept.status} and the wake {woke.status}: the client was told ({figures})")
    return green(f"GPU memory fell at the sleep and came back at the wake ({figures})")
