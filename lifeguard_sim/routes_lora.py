"""vLLM's runtime LoRA routes (``vllm/entrypoints/serve/lora/api_router.py``), mounted only with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``SimSettings.enable_lora``).

A loaded adapter is servable by name (``model`` on the OpenAI and generate routes) and listed by
``/v1/models``. Success is a plain-text 200, as vLLM's handler returns the message string.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lifeguard_sim import errors
from lifeguard_sim.keys import SIM_ENGINE


async def _body(request: web.Request) -> dict[str, Any]:
    return errors.json_object(await request.read())


def _text(message: str) -> web.Response:
    # Starlette's Response(content=str) without a media type: a body and no Content-Type.
    return web.Response(body=message.encode(), content_type="application/octet-stream")


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path or not isinstance(name, str) or not isinstance(path, str):
        raise errors.EngineHTTPError(
            400, errors.openai_error("Both 'lora_name' and 'lora_path' must be provided.", "BadRequestError", 400)
        )
    engine = request.app[SIM_ENGINE]
    return _text(await engine.load_lora_adapter(name, path, in_place=bool(body.get("load_inplace"))))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    name = (await _body(request)).get("lora_name")
    if not name or not isinstance(name, str):
        message = "'lora_name' needs to be provided to unload a LoRA adapter."
        raise errors.EngineHTTPError(400, errors.openai_error(message, "BadRequestError", 400))
    return _text(request.app[SIM_ENGINE].unload_lora_adapter(name))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
