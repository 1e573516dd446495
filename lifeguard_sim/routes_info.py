"""Always-on routes (health, version, load, metrics, models, tokenizer, OpenAPI) and the ``/sim`` routes."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from lifeguard_sim import errors, metrics
from lifeguard_sim.faults import FaultSpecError
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response
from lifeguard_sim.routes_openai import chat_prompt
from lifeguard_sim.textgen import VOCAB_SIZE, detokenize, piece, tokenize


async def health(request: web.Request) -> web.Response:
    # vLLM's /health reads only the local "errored" flag: it stays 200 while asleep, paused or waking.
    return web.Response(status=200 if request.app[SIM_ENGINE].check_health() else 503)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[SIM_ENGINE].profile.version})


async def load(request: web.Request) -> web.Response:
    return json_response({"server_load": len(request.app[SIM_ENGINE].scheduler.requests)})


async def prometheus(request: web.Request) -> web.Response:
    text = metrics.render(request.app[SIM_ENGINE])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def models(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    settings = engine.settings

    def card(name: str, root: str, parent: str | None) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": settings.max_model_len,
            "permission": [],
        }

    # vLLM lists loaded LoRA adapters after the base model, rooted at their path.
    adapters = [card(name, path, settings.model) for name, path in engine.lora_adapters.items()]
    return json_response({"object": "list", "data": [card(settings.model, settings.model, None), *adapters]})


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise errors.bad_request("Invalid JSON in request body") from None
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object")
    return body


async def tokenize_route(request: web.Request) -> web.Response:
    body = await _json(request)
    text = chat_prompt(body["messages"]) if "messages" in body else body.get("prompt")
    if not isinstance(text, str):
        raise errors.bad_request("'prompt' must be a string", "prompt")
    ids = tokenize(text)
    strs = [piece(i) for i in ids] if body.get("return_token_strs") else None
    max_len = request.app[SIM_ENGINE].settings.max_model_len
    return json_response({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})


async def detokenize_route(request: web.Request) -> web.Response:
    ids = (await _json(request)).get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < VOCAB_SIZE for i in ids):
        raise errors.bad_request(f"'tokens' must be a list of token ids below {VOCAB_SIZE}", "tokens")
    return json_response({"prompt": detokenize(ids)})


async def openapi(request: web.Request) -> web.Response:
    paths: dict[str, dict[str, object]] = {}
    for route in request.app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = str(info.get("path", ""))
        if path and route.method in ("GET", "POST") and not path.startswith("/sim"):
            paths.setdefault(path, {})[route.method.lower()] = {"responses": {"200": {"description": "OK"}}}
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "vLLM (lifeguard simulator)", "version": request.app[SIM_ENGINE].profile.version},
        "paths": dict(sorted(paths.items())),
    }
    return json_response(spec)


async def is_scaling_elastic_ep(request: web.Request) -> web.Response:
    return json_response(request.app[SIM_ENGINE].elastic_status())


async def scale_elastic_ep(request: web.Request) -> web.Response:
    """vLLM's handler (serve/elastic_ep/api_router.py), its checks in its order."""
    body = errors.http_json_object(await request.read(), not_object="Invalid JSON format")
    size = body.get("new_data_parallel_size")
    drain_timeout = body.get("drain_timeout", 120)
    if size is None:
        raise errors.http_exception(400, "new_data_parallel_size is required")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise errors.http_exception(400, "new_data_parallel_size must be a positive integer")
    if not isinstance(drain_timeout, int) or isinstance(drain_timeout, bool) or drain_timeout <= 0:
        raise errors.http_exception(400, "drain_timeout must be a positive integer")
    return json_response(await request.app[SIM_ENGINE].scale_elastic_ep(size))


async def sim_state(request: web.Request) -> web.Response:
    return json_response(request.app[SIM_ENGINE].state_dict())


async def sim_faults_get(request: web.Request) -> web.Response:
    return json_response(request.app[SIM_ENGINE].faults.active())


async def sim_faults_set(request: web.Request) -> web.Response:
    try:
        specs = json.loads(await request.read())
    except ValueError:
        specs = None
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise errors.EngineHTTPError(400, {"error": "body must be a JSON list of fault spec strings"})
    engine = request.app[SIM_ENGINE]
    try:
        engine.set_faults(specs)
    except FaultSpecError as exc:
        raise errors.EngineHTTPError(400, {"error": str(exc)}) from None
    return json_response(engine.faults.active())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health, allow_head=False)
    app.router.add_get("/ping", health, allow_head=False)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version, allow_head=False)
    app.router.add_get("/load", load, allow_head=False)
    app.router.add_get("/metrics", prometheus, allow_head=False)
    app.router.add_get("/v1/models", models, allow_head=False)
    app.router.add_post("/is_scaling_elastic_ep", is_scaling_elastic_ep)
    app.router.add_post("/scale_elastic_ep", scale_elastic_ep)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/openapi.json", openapi, allow_head=False)
    app.router.add_get("/sim/state", sim_state, allow_head=False)
    app.router.add_get("/sim/faults", sim_faults_get, allow_head=False)
    app.router.add_post("/sim/faults", sim_faults_set)
