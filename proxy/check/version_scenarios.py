"""The rows of the matrix that judge the weight version a client reads (issue 51, docs/guides/weight-versions.md):
vLLM's label names whatever the trainer last sent, so it lies after a failed chunk, after a relabel with no weight
change, and across a weight change in the middle of a stream. Each row leaves the weights as it found them: the
checkpoint's, reloaded where the row broke them, and the label the row found."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .client import Reply
from .column import WAIT_DEADLINE_S, Column, eventually
from .scenarios import Finding, green, red, skip, vllm_running

#: A chunk whose IPC handles name a GPU no engine has: vLLM's IPC transfer engine fails it mid-way ("IPC handle not
#: found for GPU UUID ...", ipc_engine.py receive_weights), and the worker ends the session (gpu_worker.py).
FAILING_CHUNK: dict[str, Any] = {
    "names": ["lifeguard.check.weight"],
    "dtype_names": ["float32"],
    "shapes": [[1]],
    "ipc_handles": [{"GPU-lifeguard-check-no-such-gpu": [0]}],
}


async def _label(col: Column) -> tuple[str | None, Reply]:
    info = await col.call("GET", "/weight_info")
    found = info.body.get("weight_version") if info.status == 200 and isinstance(info.body, dict) else None
    return (found if isinstance(found, str) else None), info


def _says_partial(reply: Reply) -> bool:
    """Whether an answer tells the client the weights are partial (the lifeguard's 409 `weights_partial`, or a
    `/weight_info` that says so), not just that a call failed."""
    if isinstance(reply.body, dict) and reply.body.get("weights_partial") is True:
        return True
    return reply.status == 409 and "partial" in reply.text


# ---------------------------------------------------------------- a label after a failed chunk
async def label_after_failed_chunk(col: Column) -> Finding:
    init = await col.call("POST", "/init_weight_transfer_engine", json_body={"init_info": {}})
    if init.status != 200:
        return skip(f"no weight transfer here: /init_weight_transfer_engine answered {init.summary()[:100]}")
    before, _ = await _label(col)
    if before is None:
        return skip("no /weight_info here (vLLM before the weight transfer API)")
    sent = "lifeguard-check-after-failed-chunk"
    started = await col.post("/start_weight_update")
    if started.status != 200:
        return skip(f"no weight update session could start: {started.summary()[:100]}")
    chunk = await col.call("POST", "/update_weights", json_body={"update_info": FAILING_CHUNK})
    if chunk.status == 200:
        await col.call("POST", "/finish_weight_update", json_body={})
        return skip("the chunk meant to fail mid-way was loaded (a transfer engine that takes no IPC handles)")
    finish = await col.call("POST", "/finish_weight_update", json_body={"weight_version": sent})
    after, info = await _label(col)
    # The weights are the checkpoint's again before anything generates on the partial ones (vLLM dies of them).
    reload = await col.rpc("reload_weights")
    if finish.status == 200 or after == sent:
        return red(
            f"after a chunk that failed ({chunk.summary()[:60]}) the finish answered {finish.summary()[:40]} and "
            f"/weight_info names {after!r}: a label published onto partial weights"
        )
    if _says_partial(finish) or _says_partial(info):
        return green(
            f"the finish answered {finish.summary()[:70]}; /weight_info: {info.summary()[:70]}: the client is told "
            f"the weights are partial, and {sent!r} was not published"
        )
    repaired = "" if reload.status == 200 else f" (the reload that repairs them answered {reload.summary()[:40]})"
    return red(
        f"a chunk failed mid-way ({chunk.summary()[:60]}), the finish answered {finish.summary()[:60]}, and "
        f"/weight_info still names {after!r} with /health 200: nothing says the weights are partial, and the next "
        f"request kills the engine{repaired}"
    )


# ---------------------------------------------------------------- a relabel without a weight change
async def relabel_without_change(col: Column) -> Finding:
    found, _ = await _label(col)
    if found is None:
        return skip("no /weight_info here (vLLM before the weight transfer API)")
    relabels = []
    for label in ("lifeguard-check-a", "lifeguard-check-b", found):  # the last puts back the label found
        relabels.append(await col.call("POST", "/update_weight_version", json_body={"new_version": label}))
    if relabels[0].status != 200:
        return skip(f"no /update_weight_version here: {relabels[0].summary()[:100]}")
    second = relabels[1]
    said = second.headers.get("X-Lifeguard-Weights-Unchanged")
    if second.status == 200 and said == "true":
        return green("the relabel with no weight change answered 200 with X-Lifeguard-Weights-Unchanged: true")
    if second.status != 200:
        return red(f"a relabel the trainer needs after an out-of-band transfer was refused: {second.summary()[:80]}")
    return red(
        f"a relabel with no weight change answered {second.summary()[:60]}"
        + (f" with X-Lifeguard-Weights-Unchanged: {said}" if said else "")
        + ": spans and /weight_info now name a new version of the same weights, and nothing says so"
    )


# ---------------------------------------------------------------- spans across a keep-mode update
_ENDED_EARLY = "the stream ended before it could be paused"


async def spans_across_keep_update(col: Column) -> Finding:
    """A stream that asked for `weight_versions`, a keep-mode pause, a reload of the weights, the resume: the spans
    must split where the reloaded weights began (a reload sets no label in vLLM: one span says it all was one).
    A stream that ended before the row saw it run is tried once more, twice as long (an idle CPU streams fast)."""
    found = await _spans_across_keep_update(col, col.stream_tokens)
    if found.why == _ENDED_EARLY:
        found = await _spans_across_keep_update(col, 2 * col.stream_tokens)
    return found


async def _spans_across_keep_update(col: Column, tokens: int) -> Finding:
    began = asyncio.Event()
    body = {"model": col.model, "prompt": "Count upward slowly:", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_weight_versions": True}  # fmt: skip
    stream = col.later(col.call("POST", "/v1/completions", json_body=body, timeout=120, first_bytes=began))

    async def running() -> bool:  # vLLM's gauge too: the lifeguard may hold a stream's first bytes back a moment
        return (began.is_set() or await vllm_running(col)) and not stream.done()

    if not await eventually(running, timeout=WAIT_DEADLINE_S, unless=stream.done):
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        return skip(_ENDED_EARLY)
    try:
        paused = await col.post("/pause", mode="keep", clear_cache="false")
        kept = not stream.done()
        reload = await col.rpc("reload_weights")
        await col.post("/resume")
        reply = await stream
    finally:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    if paused.status != 200 or not kept:
        return skip(f"the stream could not be kept by a pause ({paused.summary()[:60]})")
    if reload.status != 200:
        return skip(f"the weights could not be reloaded here: {reload.summary()[:100]}")
    if reply.status != 200:
        return red(f"the stream kept across the update ended {reply.summary()[:80]}")
    spans = _last_spans(reply.text)
    if spans is None:
        return red("the stream asked for weight_versions and lived through a reload; it came back with none")
    labels = [span.get("version") for span in spans]
    ends = [0] + [span.get("end") for span in spans]
    whole = all(span.get("start") == ends[i] for i, span in enumerate(spans)) and ends[-1] == tokens
    if len(spans) < 2 or len(set(labels)) < 2:
        return red(
            f"the weights were reloaded while the stream was paused, but its spans name one version for all its "
            f"tokens: {json.dumps(spans)[:120]}"
        )
    if not whole:
        return red(f"the spans do not cover the stream's {tokens} tokens: {json.dumps(spans)[:120]}")
    return green(f"the spans split where the reloaded weights began: {json.dumps(spans)[:140]}")


def _last_spans(text: str) -> list[dict[str, Any]] | None:
    """The `weight_versions` of the stream's last event that carries them (vLLM sends them on the last chunk)."""
    spans = None
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            event = json.loads(line[len("data: ") :])
        except ValueError:
            continue
        for choice in event.get("choices") or ():
            found = choice.get("weight_versions") if isinstance(choice, dict) else None
            if isinstance(found, list) and all(isinstance(span, dict) for span in found):
                spans = found
    return spans
