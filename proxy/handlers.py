"""aiohttp handlers: HTTP in, coordinator / gate / forwarder calls out, and the one error renderer.

Nothing here decides lifecycle questions. Errors the proxy makes itself always have vLLM's
OpenAI-style body, an `X-Lifeguard-Reason` header and, on 503, `Retry-After`; the proxy never answers
500 (an unexpected bug is logged and answered 503 `proxy_error`). Once a response has started
streaming, an error can only end the stream, never change its status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from .calls import parse_call
from .config import Settings
from .coordinator import LifecycleCoordinator
from .errors import (
    BodyTimeout,
    BodyTooLarge,
    EngineUnavailable,
    Forbidden,
    LifeguardError,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
)
from .forward import STREAM_BROKEN, Forwarder
from .gate import RequestGate
from .inflight import STREAM_ABORTED, AbortedBySleep, InFlightRequests
from .metrics import Metrics
from .routes import LIFECYCLE_PATHS, RouteKind, classify, normalise
from .states import State

log = logging.getLogger("lifeguard.http")

SETTINGS = web.AppKey("settings", Settings)
COORDINATOR = web.AppKey("coordinator", LifecycleCoordinator)
GATE = web.AppKey("gate", RequestGate)
INFLIGHT = web.AppKey("inflight", InFlightRequests)
FORWARDER = web.AppKey("forwarder", Forwarder)
METRICS = web.AppKey("metrics", Metrics)
SHUTTING_DOWN = web.AppKey("shutting_down", list)


def render_error(error: LifeguardError) -> web.Response:
    body = {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.status,
            "reason": error.reason,
            "src": "lifeguard",
        }
    }
    headers = {"X-Lifeguard-Reason": error.reason}
    if error.status == 503 or error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after or 1)))
    response = web.json_response(body, status=error.status, headers=headers)
    if error.close_connection:
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except LifeguardError as exc:
        return render_error(exc)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        return render_error(BodyTooLarge(f"the request body exceeds the limit of {limit} bytes"))
    except web.HTTPException as exc:
        if exc.status < 500:
            raise
        return render_error(LifeguardError(f"{exc.status} {exc.reason}"))
    except TimeoutError as exc:  # an OSError too: it must not be taken for a client that left
        log.warning("timeout in %s %s: %r", request.method, request.path, exc)
        return render_error(UpstreamTimeout("vLLM did not answer in time"))
    except (ConnectionResetError, OSError) as exc:
        log.debug("client connection lost: %r", exc)
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return render_error(LifeguardError("the proxy hit an unexpected error; see its log", reason="proxy_error"))


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[COORDINATOR].snapshot())


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready while we can serve or hold: a sleeping engine keeps the pod ready; a failed, never-started
    or shutting-down one does not."""
    current = request.app[COORDINATOR].state
    ready = current not in (State.FAILED, State.STARTING) and not request.app[SHUTTING_DOWN]
    return web.json_response({"ready": ready, "state": current.value}, status=200 if ready else 503)


def _check_admin(request: web.Request, settings: Settings) -> None:
    if settings.admin_token is None:
        return
    expected = settings.admin_token.get_secret_value().encode()
    offered = request.headers.get("X-Lifeguard-Token")
    if offered is None:
        auth = request.headers.get("Authorization", "")
        offered = auth[7:] if auth[:7].lower() == "bearer " else None
    if offered is None:
        raise Unauthorized("this lifecycle route needs the admin token (Authorization: Bearer or X-Lifeguard-Token)")
    if not hmac.compare_digest(offered.encode(), expected):
        raise Forbidden("the admin token is wrong")


async def proxy(request: web.Request) -> web.StreamResponse:
    """Every path not under /lifeguard/: classified once, then guarded or forwarded."""
    app = request.app
    kind = classify(request.method, request.path)
    started = time.monotonic()
    try:
        if kind is RouteKind.LIFECYCLE:
            return await _lifecycle(request, LIFECYCLE_PATHS[normalise(request.path)])
        body = await _read_body(request)
        if kind is RouteKind.INFERENCE:
            return await _inference(request, body)
        if kind is RouteKind.AT_ONCE:
            _check_admin(request, app[SETTINGS])
            if app[COORDINATOR].state is State.FAILED:
                raise EngineUnavailable("the engine has failed; control calls are refused until it is back")
        return await app[FORWARDER].forward(request, body)
    finally:
        route_class = "inference" if kind is RouteKind.INFERENCE else "lifecycle"
        if kind in (RouteKind.NEVER_GATED, RouteKind.AT_ONCE):
            route_class = "passthrough"
        app[METRICS].request_duration(route_class, time.monotonic() - started)


async def _read_body(request: web.Request) -> bytes:
    timeout = request.app[SETTINGS].client_body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None


async def _lifecycle(request: web.Request, op: str) -> web.Response:
    app = request.app
    body = await _read_body(request)
    try:
        _check_admin(request, app[SETTINGS])
        call = parse_call(op, request.query.items(), body)
    except LifeguardError as exc:
        # Refused before the coordinator sees it; still an operation outcome users want on the dashboard.
        app[METRICS].operation_finished(op, "invalid" if exc.status == 400 else "unauthorized", 0.0)
        raise
    result = await app[COORDINATOR].submit(call)
    response = web.Response(status=result.status, body=result.body, headers=result.headers)
    if result.content_type:
        response.headers["Content-Type"] = result.content_type
    return response


async def _inference(request: web.Request, body: bytes) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS]
    outcome = "forwarded"
    started = time.monotonic()
    try:
        ticket = await app[GATE].admit()
    except LifeguardError as exc:
        metrics.inference_finished(exc.reason if exc.reason in _GATE_OUTCOMES else "engine_unavailable")
        _log_not_forwarded(request, exc.reason, started)
        raise
    except BaseException:
        metrics.inference_finished("client_gone")
        _log_not_forwarded(request, "client_gone", started)
        raise
    try:
        extra = _STALE_HEADER if app[COORDINATOR].weights_stale else None
        forwarder = app[FORWARDER]
        response = await app[INFLIGHT].run(
            request, lambda entry: forwarder.forward(request, body, extra_headers=extra, inflight=entry)
        )
        if request.get(STREAM_BROKEN):
            outcome = "stream_broken"
        elif request.get(STREAM_ABORTED):
            outcome = "aborted_by_sleep"
        return response
    except AbortedBySleep:
        outcome = "aborted_by_sleep"
        raise
    except UpstreamError:
        outcome = "upstream_unreachable"
        raise
    except BaseException:
        outcome = "client_gone"
        raise
    finally:
        ticket.done()
        metrics.inference_finished(outcome)


def _log_not_forwarded(request: web.Request, reason: str, started: float) -> None:
    log.info(
        "request not forwarded: %s",
        reason,
        extra={
            "event": "hold_ended",
            "reason": reason,
            "path": request.path,
            "held_s": round(time.monotonic() - started, 4),
            "request_id": request.headers.get("X-Request-Id"),
        },
    )


_GATE_OUTCOMES = frozenset(
    {"hold_timeout", "hold_queue_full", "shutting_down", "engine_unavailable", "engine_sleeping"}
)
_STALE_HEADER = {"X-Lifeguard-Weights-Stale": "true"}
