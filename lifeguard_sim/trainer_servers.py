"""What trainers add to vLLM with their own server wrapper, for ``SimSettings.trainer_servers``.

* ``skyrl`` (``skyrl/backends/skyrl_train/inference_servers/vllm_server_actor.py``):
  ``POST /skyrl/v1/load_lora_adapter`` (an in-place ``add_lora`` from ``lora_path``, or, 0.4.0, from the
  tensors a weight update staged with ``in_memory``; JSON answer), ``POST /fetch_weights`` (0.4.0: the
  checkpoint delta fetched to disk), ``/reset_prefix_cache`` reading a JSON body, and the worker
  extension's ``/collective_rpc`` methods (``Engine._skyrl_rpc``).
* ``areal`` (``areal/engine/vllm_ext/areal_vllm_server.py``): ``/areal_pause_generation`` (the engine's
  pause with abort, plus a gate that holds new ``/v1/completions`` in the wrapper, before the engine),
  ``/areal_continue_generation``, and ``/areal_update_weights {"model_path"}`` (pause, load the
  checkpoint from disk, resume). Each answers ``{"success": bool, "message": str}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lifeguard_sim import errors
from lifeguard_sim.engine import IN_MEMORY_LORA_PREFIX
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response


async def _body(request: web.Request) -> dict[str, Any]:
    return errors.json_object((await request.read()) or b"{}")


async def skyrl_load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    name, path, in_memory = body.get("lora_name"), body.get("lora_path"), bool(body.get("in_memory", False))
    if not name or in_memory == bool(path):
        raise errors.EngineHTTPError(
            400, {"detail": "'lora_name' plus exactly one of 'lora_path' or 'in_memory': true must be provided."}
        )
    if in_memory:
        path = f"{IN_MEMORY_LORA_PREFIX}{name}"
    engine = request.app[SIM_ENGINE]
    await engine.load_lora_adapter(str(name), str(path), in_place=True)
    return json_response({"status": "ok", "lora_name": name, "lora_int_id": list(engine.lora_adapters).index(name) + 1})


async def skyrl_fetch_weights(request: web.Request) -> web.Response:
    body = await _body(request)
    version = body.get("target_version")
    if version is None:
        raise errors.EngineHTTPError(400, {"detail": "'target_version' is required"})
    result = await request.app[SIM_ENGINE].fetch_weights(int(version))
    return json_response({"status": "ok", "result": [result]})


def _areal(success: bool, message: str) -> web.Response:
    return json_response({"success": success, "message": message}, status=200 if success else 400)


async def areal_pause_generation(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    engine.trainer_gate.clear()
    await engine.pause("abort")
    return _areal(True, "Generation paused and all requests aborted")


async def areal_continue_generation(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    await engine.resume()
    engine.trainer_gate.set()
    return _areal(True, "Generation continued")


async def areal_update_weights(request: web.Request) -> web.Response:
    body = await _body(request)
    if not isinstance(body.get("model_path"), str):
        raise errors.bad_request("Field required: model_path", "body.model_path")
    engine = request.app[SIM_ENGINE]
    await engine.pause("abort")
    try:
        await engine.collective_rpc("reload_weights")  # AReaL's worker extension: areal_update_weights
        engine.weight_writes += 1
    finally:
        await engine.resume()
    return _areal(True, "TP rank: 0 success\n")


def add_routes(app: web.Application, trainers: frozenset[str]) -> None:
    if "skyrl" in trainers:
        app.router.add_post("/skyrl/v1/load_lora_adapter", skyrl_load_lora_adapter)
        app.router.add_post("/fetch_weights", skyrl_fetch_weights)
    if "areal" in trainers:
        app.router.add_post("/areal_pause_generation", areal_pause_generation)
        app.router.add_post("/areal_continue_generation", areal_continue_generation)
        app.router.add_post("/areal_update_weights", areal_update_weights)
