"""``POST /inference/v1/generate``: vLLM 0.32's token-in/token-out route
(``vllm/entrypoints/scale_out/token_in_token_out/``), mounted only with ``--enable-scale-out``
(``SimSettings.enable_scale_out``). Without it vLLM 0.32 still routes the path, to a stand-in that answers
403 ``PermissionDeniedError`` (``register_scale_out_api_routers`` in ``vllm/entrypoints/scale_out/factories.py``),
and so does the simulator.

Request: ``token_ids`` (non-empty, non-negative), ``sampling_params`` (vLLM's SamplingParams: here
``max_tokens``, ``logprobs``, ``n``), optional ``model``, ``request_id``, ``return_token_ids``.
Answer (``output_mode: "tokens"``): one choice per sample with ``token_ids`` and, when asked for,
``logprobs.content[*]`` as ``{token_id, logprob, rank, top_logprobs}``. The simulator does not stream here.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from lifeguard_sim import errors, generation
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.prefix_cache import salt_problem
from lifeguard_sim.responses import json_response
from lifeguard_sim.routes_openai import check_model, json_body
from lifeguard_sim.scheduler import spans
from lifeguard_sim.textgen import VOCAB_SIZE, Token, piece_id


def _validated(raw: bytes) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    body = json_body(raw)
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in ids):
        raise errors.bad_request(f"'token_ids' must be a non-empty list of token ids below {VOCAB_SIZE}", "token_ids")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise errors.bad_request("'sampling_params' is required and must be an object", "sampling_params")
    if body.get("stream"):
        raise errors.bad_request("the simulator's /inference/v1/generate does not stream", "stream")
    if params.get("n", 1) != 1:
        raise errors.bad_request("the simulator's /inference/v1/generate serves n=1", "sampling_params.n")
    if (problem := salt_problem(body.get("cache_salt"))) is not None:
        raise errors.bad_request(problem, "cache_salt")
    return ids, params, body


def _logprob(token: Token) -> dict[str, Any]:
    top = [{"token_id": piece_id(text), "logprob": lp, "rank": rank} for rank, (text, lp) in enumerate(token.top, 1)]
    return {"token_id": token.id, "logprob": token.logprob, "rank": 1, "top_logprobs": top}


async def generate_route(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    ids, params, body = _validated(await request.read())
    model = check_model(engine, body.get("model"))
    max_tokens = params.get("max_tokens", 16)
    room = engine.settings.max_model_len - len(ids)
    if max_tokens is not None and (not isinstance(max_tokens, int) or not 1 <= max_tokens <= room):
        raise errors.bad_request(f"max_tokens must be 1..{room}", "sampling_params.max_tokens")
    logprobs = params.get("logprobs")
    await engine.trainer_gate.wait()
    req = generation.new_request(
        "gen",
        prompt_tokens=len(ids),
        max_tokens=room if max_tokens is None else max_tokens,
        external_id=request.headers.get("X-Request-Id"),
        client_gone=lambda: request.transport is None or request.transport.is_closing(),
    )
    fired = await generation.admit(engine, req)
    prompt = generation.Prompt(" ".join(map(str, ids)), tuple(ids), model, body.get("cache_salt"), int(logprobs or 0))
    produced: list[Token] = []
    tokens = generation.generate(engine, req, prompt, fired, natural_stop=max_tokens is None)
    async with contextlib.aclosing(tokens):
        produced = [token async for token in tokens]
    choice = {
        "index": 0,
        "finish_reason": req.finish_reason,
        "stop_reason": None,
        "token_ids": [t.id for t in produced],
        "routed_experts": None,
        "sampling_mask": None,
        # Every release since 0.32 (scale_out/token_in_token_out/serving.py): the spans, asked for or not.
        "weight_versions": spans(req.version_starts, req.produced),
        "logprobs": None if logprobs is None else {"content": [_logprob(t) for t in produced]},
    }
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(produced), "total_tokens": len(ids) + len(produced)}
    return json_response(
        {
            "request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex}",
            "model": model,
            "created": int(time.time()),
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": ids if body.get("return_token_ids") else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }
    )


SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


async def disabled_route(request: web.Request) -> web.Response:
    raise errors.EngineHTTPError(403, errors.openai_error(SCALE_OUT_DISABLED, "PermissionDeniedError", 403))


def add_routes(app: web.Application, enabled: bool) -> None:
    app.router.add_post("/inference/v1/generate", generate_route if enabled else disabled_route)
