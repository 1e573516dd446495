"""What trainers add to vLLM with their own server wrapper, for ``SimSettings.trainer_servers``.

* ``skyrl`` (``skyrl/backends/skyrl_train/inference_servers/vllm_server_actor.py``):
  ``POST /skyrl/v1/load_lora_adapter`` (an in-place ``add_lora``; JSON answer), and the worker
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
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response


async def _body(request: web.Request) -> dict[str, Any]:
    return errors.json_object((await request.read()) or b"{}")


async def skyrl_load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise errors.EngineHTTPError(400, {"detail": "Both 'lora_name' and 'lora_path' must be provided."})
    engine = request.app[SIM_ENGINE]
    await engine.load_lora_adapter(str(name), str(path), in_place=True)
    return json_response({"status": "ok", "lora_name": name, "lora_int_id": list(engine.lora_adapters).index(name) + 1})


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
    if "areal" in trainers:
        app.router.add_post("/areal_pause_generation", areal_pause_generation)
        app.router.add_post("/areal_continue_generation", areal_continue_generation)
        app.router.add_post("/areal_update_weights", areal_update_weights)
