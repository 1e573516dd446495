"""vLLM 0.34's fault-tolerance routes (`vllm/entrypoints/serve/fault_tolerance/api_router.py`), attached with
`--enable-fault-tolerance` (`SimSettings.enable_fault_tolerance`); the engine side is in
`lifeguard_sim/fault_tolerance.py`.

* `POST /v1/fault_tolerance/apply {"instruction": "retry"|"scale_down", "params": {...}, "request_id": "..."}`: a
  JSON content type (else vLLM's 400 "Unsupported Media Type"), each field checked in vLLM's order with its
  HTTPException 400, then 202 `{"message": "Request accepted; poll /v1/fault_tolerance/status for updates.",
  "request_id": ...}`. vLLM runs the recovery after the answer; the simulator runs it before, at once.
* `GET /v1/fault_tolerance/status`: `{"schema_version": 1, "total_engines": 1, "engines": [<the engine's entry>]}`.
"""

from __future__ import annotations

from aiohttp import web

from lifeguard_sim import errors
from lifeguard_sim.fault_tolerance import INSTRUCTIONS
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response

ACCEPTED = "Request accepted; poll /v1/fault_tolerance/status for updates."
_MEDIA_TYPE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


async def apply(request: web.Request) -> web.Response:
    if request.content_type != "application/json":  # validate_json_request (serve/utils/api_utils.py)
        raise errors.EngineHTTPError(400, errors.openai_error(_MEDIA_TYPE, "Bad Request", 400))
    body = errors.http_json_object(await request.read(), not_object="Request body must be a JSON object.")
    instruction = body.get("instruction")
    if not instruction:
        raise errors.http_exception(400, "'instruction' is required.")
    if not isinstance(instruction, str) or instruction not in INSTRUCTIONS:
        raise errors.http_exception(400, f"Invalid instruction: '{instruction}'.")
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise errors.http_exception(400, "'params' must be an object.")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise errors.http_exception(400, "'request_id' must be a non-empty string.")
    request.app[SIM_ENGINE].fault_tolerance_apply(instruction, params, request_id)
    return json_response({"message": ACCEPTED, "request_id": request_id}, status=202)


async def status(request: web.Request) -> web.Response:
    # The client's cached entries: answered even by a dead engine.
    return json_response(request.app[SIM_ENGINE].ft.status_body())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/fault_tolerance/apply", apply)
    app.router.add_get("/v1/fault_tolerance/status", status, allow_head=False)
