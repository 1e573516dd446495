"""vLLM's error bodies, built in one place, and the exceptions that carry them out of the engine.

vLLM answers in three shapes: the OpenAI envelope ``{"error": {message, type, param, code}}``, FastAPI
validation (the same envelope, type "Bad Request", ``param`` like ``"query.level"``), and the plain
``{"error": "<string>"}`` of the pause/resume/abort handlers.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from lifeguard_sim.fault_tolerance import FAULTED_MESSAGE
from lifeguard_sim.versions import ENGINE_DEAD_LOG_MESSAGE

OOM_MESSAGE = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"
# str(EngineDeadError): what /is_paused quotes in every release; clients of 0.33 are told the profile's message.
ENGINE_DEAD_MESSAGE = ENGINE_DEAD_LOG_MESSAGE
# RequestError(code="engine_paused").message (vLLM 0.33 v1/engine/core.py `_reject_add_while_paused`).
ENGINE_PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
# serve/elastic_ep/middleware.py (0.33; 0.32 has only the first)
SCALING_MESSAGE = "The model is currently scaling. Please try again later."
RETIRED_MESSAGE = "This data-parallel rank has been retired and is awaiting shutdown."

Body = dict[str, Any]


class EngineHTTPError(Exception):
    """An engine outcome that vLLM reports as a non-200 answer."""

    def __init__(self, status: int, body: Body) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


class EngineGone(Exception):
    """The simulated process is gone (crashed, watchdog exit, or shutting down): no answer at all."""


class EnginePaused(Exception):
    """vLLM 0.33 refused a new request on arrival (`RequestError(code="engine_paused")`): a non-streaming request is
    answered 503 (`engine_paused_body`), a streaming one 200 and then the error as its only event
    (`engine_paused_event`). The code itself never reaches the client."""


def engine_paused_body() -> Body:
    """RetryableRequestError through create_error_response: 503 ServiceUnavailableError (sent as compact JSON)."""
    return openai_error(ENGINE_PAUSED_MESSAGE, "ServiceUnavailableError", 503)


def engine_paused_event(*, chat: bool) -> bytes:
    """The SSE event vLLM 0.33 sends instead of tokens. Completions (`completion_stream_generator`):
    create_streaming_error_response, i.e. json.dumps with its default separators. Chat
    (`chat_completion_stream_generator_raw`): create_error_response(str(e), "InternalServerError", 503), dumped
    compact by pydantic."""
    if chat:
        payload = json.dumps(openai_error(ENGINE_PAUSED_MESSAGE, "InternalServerError", 503), separators=(",", ":"))
    else:
        payload = json.dumps(openai_error(ENGINE_PAUSED_MESSAGE, "ServiceUnavailableError", 503))
    return f"data: {payload}\n\n".encode()


class ClientLeft(Exception):
    """The caller disconnected before its request reached the engine; nobody is left to answer."""


def openai_error(message: str, err_type: str, code: int, param: str | None = None) -> Body:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def http_exception(status: int, detail: str) -> EngineHTTPError:
    """FastAPI's HTTPException through vLLM's handler: the OpenAI envelope, typed with the status's phrase."""
    return EngineHTTPError(status, openai_error(detail, HTTPStatus(status).phrase, status))


def http_json_object(raw: bytes, not_object: str) -> dict[str, Any]:
    """A body a vLLM handler reads with `await raw_request.json()`: HTTPException 400 "Invalid JSON format" when it
    does not parse, `not_object` when it is not an object."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise http_exception(400, "Invalid JSON format") from None
    if not isinstance(body, dict):
        raise http_exception(400, not_object)
    return body


def bad_request(message: str, param: str | None = None) -> EngineHTTPError:
    return EngineHTTPError(400, openai_error(message, "BadRequestError", 400, param))


def validation_error(
    loc: str, kind: str, msg: str, value: str, ctx: dict[str, object] | None = None
) -> EngineHTTPError:
    detail: dict[str, object] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx:
        detail["ctx"] = ctx
    return EngineHTTPError(400, openai_error(f"1 validation error:\n  {detail!r}", "Bad Request", 400, loc))


def method_failed(method: str, message: str) -> EngineHTTPError:
    return EngineHTTPError(500, openai_error(f"Call to {method} method failed: {message}", "InternalServerError", 500))


def worker_failed(message: str) -> EngineHTTPError:
    """Weight-transfer errors travel through collective_rpc, and vLLM says so in the message."""
    return method_failed("collective_rpc", f"Worker failed with error '{message}'")


def out_of_memory(op: str) -> EngineHTTPError:
    """What vLLM answers when `op` fails on a CUDA out-of-memory (the simulator's error500 and wedge faults)."""
    if op == "pause":
        return plain_error(500, f"Failed to pause generation: {OOM_MESSAGE}")
    if op == "resume":
        return plain_error(500, f"Failed to resume generation: {OOM_MESSAGE}")
    if op in ("sleep", "wake_up", "checkpoint_prepare", "checkpoint_restore"):
        return method_failed(op, OOM_MESSAGE)
    if op == "generate":
        return EngineHTTPError(500, openai_error(OOM_MESSAGE, "InternalServerError", 500))
    return worker_failed(OOM_MESSAGE)


def engine_dead(message: str = ENGINE_DEAD_MESSAGE) -> EngineHTTPError:
    return EngineHTTPError(500, openai_error(message, "InternalServerError", 500))


def plain_error(status: int, message: str) -> EngineHTTPError:
    return EngineHTTPError(status, {"error": message})


def json_object(raw: bytes, *, decode_message: str = "JSON decode error") -> dict[str, Any]:
    """A request body that must be a JSON object, refused as vLLM refuses it (400, OpenAI envelope);
    `decode_message` is the route's own wording for a body that is not JSON."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request(decode_message) from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def engine_faulted() -> EngineHTTPError:
    """vLLM 0.34's EngineFaultedError (a GracefulHTTPError: its status's phrase as the type), raised by check_admission
    before the request is added, so a stream gets it as a plain 503 too."""
    return EngineHTTPError(503, openai_error(FAULTED_MESSAGE, "Service Unavailable", 503))
