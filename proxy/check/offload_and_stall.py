"""Two rows of the matrix (proxy/check/matrix.py) on what vLLM's flags and `/health` never show: a KV connector's
offload tier kept through a sleep and then read after a weight change (vLLM 0.34, docs/verification.md class 28), and
a stall behind a healthy `/health` (class 27). Same code on both columns, as every row (scenarios.py)."""

from __future__ import annotations

from ..lifecycle.vllm_release import at_least
from .column import Column, completion_text, eventually
from .scenarios import CACHED_PROMPT, Finding, green, red, skip

#: How long the simulator's stall lasts, in pending windows (the command's: 2 s): above the `stall_after_s` the matrix
#: runs the lifeguard with (scripts/check-matrix.sh), and a few of its reconcile rounds.
STALL_WINDOWS = 5
_OWN_SALT = "lifeguard-check-fresh"


async def kept_offload_tier(col: Column) -> Finding:
    """A sleep told `reset_connector=false`, a weight update, the client's `/reset_prefix_cache` (as trainers send
    it), then the cached prompt: answered from KV the old weights computed where the tier kept its blocks."""
    version = (await col.http.get("/version", timeout=10)).body
    found = version.get("version") if isinstance(version, dict) else None
    if not at_least(found, (0, 34)):
        return skip(f"reset_connector is vLLM 0.34's (this is {found or 'an unknown version'})")
    init = await col.call("POST", "/init_weight_transfer_engine", json_body={"init_info": {}})
    if init.status != 200:
        return skip(f"no weight transfer here to change the weights: {init.summary()[:100]}")
    try:
        before = completion_text(await col.completion(prompt=CACHED_PROMPT))
        slept = await col.call("POST", "/sleep", params={"level": "1", "reset_connector": "false"})
        await col.wake()
        if slept.status != 200:
            return green(f"the sleep answered {slept.summary()[:80]}: the client knows it did not sleep")
        steps: tuple[tuple[str, dict[str, object]], ...] = (
            ("/start_weight_update", {}),
            ("/update_weights", {"update_info": {}}),
            ("/finish_weight_update", {}),
        )
        for path, body in steps:
            if (reply := await col.call("POST", path, json_body=body)).status != 200:
                return skip(f"the weights could not be changed here: POST {path} answered {reply.summary()[:80]}")
        reset = await col.post("/reset_prefix_cache")
        cached = completion_text(await col.completion(prompt=CACHED_PROMPT))
        fresh = completion_text(await col.completion(prompt=CACHED_PROMPT, cache_salt=_OWN_SALT))
    finally:
        await col.post("/reset_prefix_cache", reset_external="true")  # the tier left empty for the rows after
    if fresh == before:
        return skip("the update did not change this prompt's answer here: old KV could not be told from new")
    if cached != fresh:
        return red(
            f"after a sleep that kept the KV connector's tier, a weight update and /reset_prefix_cache "
            f"{reset.summary()[:40]}, the cached prompt answered {cached!r} (KV the old weights computed), "
            f"a fresh computation {fresh!r}"
        )
    said = reset.headers.get("X-Lifeguard-Prefix-Cache")
    return green(f"the cached prompt answered as the new weights compute it (the reset said {said or reset.summary()})")


async def stall_behind_health(col: Column) -> Finding:
    """A request in flight with no byte for seconds while `/health` answers 200: does anything tell a router?"""
    if col.lifeguard and (await col.lifeguard_state()).get("policies", {}).get("stall_after_s") is None:
        return skip("the lifeguard's stall watch is off (stall_after_s unset): nothing is watched to tell")
    stall_s = STALL_WINDOWS * col.pending_window_s
    armed = await col.call("POST", "/sim/faults", json_body=[f"generate:stall:{stall_s:g}"])
    if armed.status != 200:
        return skip(
            "a stall cannot be made from outside the engine: only the simulator's generate:stall:S fault makes one "
            "(field reports: hours at 0 tokens/s behind a /health 200)"
        )
    pending = col.later(col.completion(timeout=stall_s + 30))

    async def said_stalled() -> bool:
        serving = await col.http.get("/lifeguard/serving", timeout=10)
        error = serving.body.get("error") if isinstance(serving.body, dict) else None
        return serving.status == 503 and isinstance(error, dict) and error.get("cause") == "stalled"

    # vLLM has nothing to ask: a router sees only /health.
    told = col.lifeguard and await eventually(said_stalled, timeout=stall_s, unless=pending.done)
    health = await col.http.get("/health", timeout=10)
    stalled = not pending.done()
    reply = await pending
    if told:
        return green(f"/lifeguard/serving answered 503 stalled while the request made no progress (/health: "
                     f"{health.status}); the request then answered {reply.summary()[:40]}")  # fmt: skip
    if not stalled:
        return skip(f"the request was answered before the stall showed: {reply.summary()[:60]}")
    return red(
        f"a request made no progress for seconds while /health answered {health.status}: nothing told a router or a "
        f"client (the request then answered {reply.summary()[:40]})"
    )
