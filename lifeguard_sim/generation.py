"""A generation request's life inside the engine: arrival, hold, admission, token steps, finish.

The coroutine answering the HTTP request drives its own generation through ``generate``; it parks
whenever the scheduler may not admit or step it, so holding, freezing (``keep``) and aborting all come
from the engine's pause state rather than from the route.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from lifeguard_sim import errors
from lifeguard_sim.engine import Engine
from lifeguard_sim.errors import ClientLeft, EngineGone
from lifeguard_sim.faults import Fired
from lifeguard_sim.scheduler import SimRequest, track
from lifeguard_sim.textgen import Quality, Token, TokenStream


@dataclass(frozen=True)
class Prompt:
    """What a request's answer depends on besides the weights: its text (and token ids), the model or LoRA adapter it
    names, and its `cache_salt`."""

    text: str
    ids: tuple[int, ...]
    model: str
    salt: str | None = None
    top_logprobs: int = 0


def new_request(
    prefix: str,
    *,
    prompt_tokens: int,
    max_tokens: int,
    external_id: str | None,
    client_gone: Callable[[], bool],
) -> SimRequest:
    request_id = f"{prefix}-{uuid.uuid4().hex[:16]}"
    return SimRequest(request_id, external_id, prompt_tokens, max_tokens, client_gone)


async def admit(engine: Engine, req: SimRequest) -> Fired:
    """The request reaches the engine; from here on it is tracked, and held while the scheduler is paused."""
    set_out = time.time()
    fired = await engine.enter("generate")  # a slow fault delays the arrival itself
    if engine.ft.refuses:
        raise errors.engine_faulted()  # vLLM 0.34's check_admission, before the request is added
    if req.client_gone():
        # vLLM cancels a handler whose client disconnected before it added the request: it never arrives.
        raise ClientLeft
    # Checked on arrival at the scheduler, after any delay: a request that set out while the engine was
    # awake but arrives once a sleep has begun is in transit, and must be seen as such.
    req.set_out = set_out
    if engine.asleep_tags or engine.is_paused:
        state = f"asleep={sorted(engine.asleep_tags)} pause={engine.scheduler.pause_state.value}"
        engine.violate("generate_while_asleep_or_paused", f"{req.request_id} arrived with {state}", set_out=set_out)
    if engine.reject_new_requests:
        raise errors.EnginePaused  # vLLM 0.33: ended on arrival, nothing queued or run
    if fired.kind == "garbage":
        engine.garbage = True
    if fired.kind == "stall":
        engine.stalled_until = time.monotonic() + fired.seconds
    engine.scheduler.add(req)
    return fired


def prefill(engine: Engine, req: SimRequest, prompt: Prompt) -> tuple[TokenStream, str]:
    """`req`'s tokens, once it is scheduled, and the weights they follow: the engine's, unless its prompt reuses
    prefix-cache blocks (or offload-tier blocks) that older weights computed (vLLM keeps them until a reset
    succeeds); its answer then follows those."""
    weights = engine.model_seed(prompt.model)
    path = engine.lora_adapters.get(prompt.model)
    lora = f"{prompt.model}:{path}" if path is not None else None  # vLLM keys an adapter's blocks by name and path
    reused, older = engine.prefix_cache.serve(list(prompt.ids), salt=prompt.salt, lora=lora, weights=weights)
    # Inside a weight update session the weights are half written and nothing is committed: the proxy holds
    # inference then, and one a proxy restart knows nothing of (an orphaned session) is outside its guarantee.
    if older is not None and not engine.weight_update_active:
        kind, blocks = (
            ("prefix_cache_stale_hit", "prefix-cache blocks")
            if engine.prefix_cache.older_from == "gpu"
            else ("offload_tier_stale_hit", "KV connector offload-tier blocks")
        )
        engine.violate(
            kind,
            f"{req.request_id} reused {reused} prompt tokens of {blocks} computed by older weights",
            set_out=req.set_out,
            committed_at=engine.weights_committed_at,
        )
    seed = older or weights
    return TokenStream(seed, prompt.text, top_logprobs=prompt.top_logprobs), seed


async def generate(
    engine: Engine, req: SimRequest, prompt: Prompt, fired: Fired, *, natural_stop: bool
) -> AsyncGenerator[Token, None]:
    """Tokens for ``req``; when it ends, ``req.finish_reason`` says why (None: the client left)."""
    sched = engine.scheduler
    try:
        await sched.until(lambda: sched.admits, req)
        if req.finished:
            return
        req.running = True
        sched.notify()
        _check_run_safety(engine, req)
        stream, follows = prefill(engine, req, prompt)
        loaded = engine.model_seed(prompt.model)
        natural_end = stream.natural_length
        text = ""
        fail_at = max(1, req.max_tokens // 2) if fired.kind in ("crash", "engine-fault") else None
        reason = "length"
        while req.produced < req.max_tokens:
            if natural_stop and req.produced >= natural_end:
                reason = "stop"
                break
            await sched.until(lambda: sched.steps and not engine.stalled, req)
            await asyncio.sleep(engine.settings.token_seconds)
            if sched.gone:
                raise EngineGone
            if req.finished:
                return
            engine.check_step()
            if not engine.weights_valid and not req.ran_on_invalid_weights:
                # A request frozen by `mode=keep` (or queued) across a level-2 sleep steps on after the wake.
                req.ran_on_invalid_weights = True
                engine.violate("generate_with_invalid_weights", f"{req.request_id} ran on discarded weights")
            if engine.weights_altered and engine.weights_valid and not req.ran_on_altered_weights:
                # Weights that fail their checksums (a lie-weights wake or reload): only the checksums can tell.
                req.ran_on_altered_weights = True
                engine.violate("generate_with_altered_weights", f"{req.request_id} ran on weights that fail their "
                               "checksums")  # fmt: skip
            if engine.model_seed(prompt.model) != loaded:
                # The weights changed under a running request (a keep-mode pause, an update, a resume): vLLM samples
                # the next tokens with the new weights, as a new request for the prompt and the text so far would.
                loaded = follows = engine.model_seed(prompt.model)
                stream = TokenStream(follows, prompt.text + text, top_logprobs=prompt.top_logprobs)
                natural_end = req.produced + stream.natural_length
            track(req.version_starts, engine.weight_version, req.produced)
            track(req.weights_starts, follows, req.produced)
            token = stream.next(_quality(engine))
            text += token.text
            req.produced += 1
            sched.stats.generation_tokens += 1
            yield token
            if fail_at is not None and req.produced >= fail_at:
                fail_at = None
                if fired.kind == "crash":
                    engine.die("crash fault during generate")
                    raise EngineGone
                engine.core_fault()
        sched.finish(req, reason)
        engine.after(fired)
    finally:
        if not req.finished and sched.gone:
            sched.requests.pop(req.request_id, None)
        elif not req.finished:
            sched.finish(req, None)
        engine.answered(req)


def _check_run_safety(engine: Engine, req: SimRequest) -> None:
    if engine.memory_asleep:
        asleep = sorted(engine.memory_asleep)
        engine.violate("generate_ran_while_asleep", f"{req.request_id} ran with {asleep} asleep")


def _quality(engine: Engine) -> Quality:
    if engine.garbage or (engine.q_scale_lost and engine.weights_valid):
        return Quality.DEGENERATE
    return Quality.NORMAL if engine.weights_valid else Quality.GARBLED
