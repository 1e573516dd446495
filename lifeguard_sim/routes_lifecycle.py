"""vLLM's dev-mode lifecycle routes: sleep, pause, caches, collective_rpc and weight updates.

Handlers validate the HTTP input the way FastAPI does in vLLM, then hand over to the engine.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from lifeguard_sim import errors
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response

_MODES = ("abort", "wait", "keep")
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    loc = f"query.{name}"
    try:
        value = int(raw)
    except ValueError:
        raise errors.validation_error(
            loc, "int_parsing", "Input should be a valid integer, unable to parse string as an integer", raw
        ) from None
    if value < low:
        msg = f"Input should be greater than or equal to {low}"
        raise errors.validation_error(loc, "greater_than_equal", msg, raw, {"ge": low})
    if value > high:
        msg = f"Input should be less than or equal to {high}"
        raise errors.validation_error(loc, "less_than_equal", msg, raw, {"le": high})
    return value


def mode_query(request: web.Request, default: str = "abort") -> str:
    raw = request.query.get("mode", default)
    if raw not in _MODES:
        expected = "'abort', 'wait' or 'keep'"
        raise errors.validation_error(
            "query.mode", "literal_error", f"Input should be {expected}", raw, {"expected": expected}
        )
    return raw


def bool_query(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise errors.validation_error(
        f"query.{name}", "bool_parsing", "Input should be a valid boolean, unable to interpret input", raw
    )


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise errors.EngineHTTPError(400, errors.openai_error("JSON decode error", "Bad Request", 400)) from None
    if not isinstance(body, dict):
        raise errors.EngineHTTPError(400, errors.openai_error("Request body must be a JSON object", "Bad Request", 400))
    return body


def _required(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise errors.EngineHTTPError(400, errors.openai_error(f"Missing '{key}' in request body", "Bad Request", 400))
    return body[key]


def _ok(body: dict[str, object]) -> web.Response:
    return json_response(body)


def _reset_connector(request: web.Request) -> bool:
    """vLLM 0.34's `reset_connector` query (default true); earlier releases do not read it (FastAPI ignores an unknown
    query parameter), and every cache-clearing sleep resets the connector."""
    if not request.app[SIM_ENGINE].profile.reset_connector_param:
        return True
    return bool_query(request, "reset_connector", True)


async def sleep(request: web.Request) -> web.Response:
    level = _int_query(request, "level", 1, 0, 2)
    mode = mode_query(request)
    reset_connector = _reset_connector(request)
    return _ok(await request.app[SIM_ENGINE].sleep(level, mode, reset_connector))


async def wake_up(request: web.Request) -> web.Response:
    tags = request.query.getall("tags", [])
    return _ok(await request.app[SIM_ENGINE].wake_up(list(tags) or None))


async def release_kv_cache_memory(request: web.Request) -> web.Response:
    return _ok(await request.app[SIM_ENGINE].release_kv_cache_memory(_reset_connector(request)))


async def is_sleeping(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    engine.check_alive()
    return _ok({"is_sleeping": engine.is_sleeping})


async def pause(request: web.Request) -> web.Response:
    mode = mode_query(request)
    if bool_query(request, "wait_for_inflight_requests", False):
        mode = "wait"
    bool_query(request, "clear_cache", True)
    return _ok(await request.app[SIM_ENGINE].pause(mode))


async def resume(request: web.Request) -> web.Response:
    return _ok(await request.app[SIM_ENGINE].resume())


async def is_paused(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    if engine.errored:
        raise errors.plain_error(500, f"Failed to fetch pause status: {errors.ENGINE_DEAD_MESSAGE}")
    engine.check_alive()
    return _ok({"is_paused": engine.is_paused})


async def abort_requests(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise errors.plain_error(400, "Invalid JSON format") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    return _ok(request.app[SIM_ENGINE].abort_requests(list(ids) if ids else None))


async def reset_prefix_cache(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    if "skyrl" in engine.settings.trainer_servers:
        # SkyRL's server wrapper (vllm_server_actor.py) replaces the route: a JSON body, {"status": "ok"}.
        try:
            body = json.loads((await request.read()) or b"{}")
        except ValueError:
            body = {}
        running = bool(body.get("reset_running_requests", False)) if isinstance(body, dict) else False
        await engine.reset_prefix_cache(running)
        return _ok({"status": "ok"})
    reset_running = bool_query(request, "reset_running_requests", False)
    reset_external = bool_query(request, "reset_external", False)
    return _ok(await engine.reset_prefix_cache(reset_running, reset_external))


async def reset_other_cache(request: web.Request) -> web.Response:
    request.app[SIM_ENGINE].check_alive()
    return web.Response(status=200)


async def collective_rpc(request: web.Request) -> web.Response:
    body = await _json_object(request)
    method = _required(body, "method")
    kwargs = body.get("kwargs")
    result = await request.app[SIM_ENGINE].collective_rpc(str(method), kwargs if isinstance(kwargs, dict) else None)
    return web.Response(status=200) if result is None else _ok(result)


async def init_weight_transfer_engine(request: web.Request) -> web.Response:
    body = await _json_object(request)
    _required(body, "init_info")
    return _ok(request.app[SIM_ENGINE].init_weight_transfer_engine())


async def start_weight_update(request: web.Request) -> web.Response:
    return _ok(await request.app[SIM_ENGINE].start_weight_update())


async def start_draft_weight_update(request: web.Request) -> web.Response:
    return _ok(await request.app[SIM_ENGINE].start_weight_update(draft=True))


async def update_weights(request: web.Request) -> web.Response:
    body = await _json_object(request)
    update_info = _required(body, "update_info")
    return _ok(await request.app[SIM_ENGINE].update_weights(update_info if isinstance(update_info, dict) else None))


def _label(body: dict[str, Any], key: str, *, required: bool) -> str | None:
    """A weight-version label: FastAPI's `Annotated[str, Body(embed=True)]` (rl/online/api_router.py) takes a string
    and nothing else (pydantic does not turn a number into one), null only where the label is optional."""
    if key not in body and required:
        raise errors.validation_error(f"body.{key}", "missing", "Field required", "None")
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise errors.validation_error(f"body.{key}", "string_type", "Input should be a valid string", str(value))
    return value


async def finish_weight_update(request: web.Request) -> web.Response:
    raw = await request.read()
    version = _label(await _json_object(request), "weight_version", required=False) if raw.strip() else None
    return _ok(await request.app[SIM_ENGINE].finish_weight_update(version))


async def update_weight_version(request: web.Request) -> web.Response:
    version = _label(await _json_object(request), "new_version", required=True)
    assert version is not None
    return _ok(request.app[SIM_ENGINE].update_weight_version(version))


async def weight_info(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    engine.check_alive()
    return _ok({"weight_version": engine.weight_version})


async def get_world_size(request: web.Request) -> web.Response:
    bool_query(request, "include_dp", True)
    return _ok({"world_size": 1})


async def server_info(request: web.Request) -> web.Response:
    settings = request.app[SIM_ENGINE].settings
    config_format = request.query.get("config_format", "text")
    if config_format not in ("text", "json"):
        expected = "'text' or 'json'"
        raise errors.validation_error(
            "query.config_format", "literal_error", f"Input should be {expected}", config_format, {"expected": expected}
        )
    config: object = (
        f"model='{settings.model}', served_model_name='{settings.model}', "
        f"max_model_len={settings.max_model_len}, enable_sleep_mode={settings.sleep_mode}, simulator=True"
    )
    if config_format == "json":
        # A small subset of pydantic's dump of VllmConfig: the keys trainers read (TRL: model_config.dtype,
        # weight_transfer_config). torch dtypes are dumped with str(), hence the "torch." prefix.
        config = {
            "model_config": {
                "model": settings.model,
                "served_model_name": settings.model,
                "dtype": f"torch.{settings.dtype}",
                "max_model_len": settings.max_model_len,
            },
            "cache_config": {"enable_sleep_mode": settings.sleep_mode},
            "lora_config": {"max_loras": 1} if settings.enable_lora else None,
            "weight_transfer_config": {"backend": "nccl"},
        }
    return _ok({"vllm_config": config, "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"}, "system_env": {}})


def add_routes(app: web.Application) -> None:
    post = {
        "/sleep": sleep,
        "/wake_up": wake_up,
        "/release_kv_cache_memory": release_kv_cache_memory,
        "/pause": pause,
        "/resume": resume,
        "/abort_requests": abort_requests,
        "/reset_prefix_cache": reset_prefix_cache,
        "/reset_mm_cache": reset_other_cache,
        "/reset_encoder_cache": reset_other_cache,
        "/collective_rpc": collective_rpc,
        "/init_weight_transfer_engine": init_weight_transfer_engine,
        "/start_weight_update": start_weight_update,
        "/start_draft_weight_update": start_draft_weight_update,
        "/update_weights": update_weights,
        "/finish_weight_update": finish_weight_update,
        "/update_weight_version": update_weight_version,
    }
    get = {
        "/is_sleeping": is_sleeping,
        "/is_paused": is_paused,
        "/weight_info": weight_info,
        "/get_world_size": get_world_size,
        "/server_info": server_info,
    }
    for path, handler in post.items():
        app.router.add_post(path, handler)
    for path, handler in get.items():
        app.router.add_get(path, handler, allow_head=False)
