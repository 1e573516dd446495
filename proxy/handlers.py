"""aiohttp handlers: HTTP in, coordinator / gate / forwarder calls out, and the one error renderer.

Nothing here decides lifecycle questions. Errors the proxy makes itself always have vLLM's
OpenAI-style body, an `X-Lifeguard-Reason` header and, on 503, `Retry-After`; the proxy never answers
500 (an unexpected bug is logged and answered 503 `proxy_error`). Once a response has started
streaming, an error can only end the stream, never change its status.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import json
import logging
import math
import time
from functools import partial

from aiohttp import web
from aiohttp.typedefs import Handler

from .calls import parse_call
from .config import Settings
from .coordinator import LifecycleCoordinator
from .errors import (
    BodyTimeout,
    BodyTooLarge,
    Forbidden,
    LifeguardError,
    Unauthorized,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
)
from .forward import STREAM_BROKEN, Forwarder
from .gate import RequestGate
from .inflight import STREAM_ABORTED, AbortedBySleep, InFlightRequests
from .metrics import Metrics
from .outcome import Outcome
from .routes import LIFECYCLE_PATHS, RouteKind, RouteTable
from .rules import control_refusal
from .serving import SERVING, engine_refusal
from .states import State
from .target import Target, below_mount, canonical_target
from .unknown_routes import UnknownRoutes

log = logging.getLogger("lifeguard.http")

SETTINGS = web.AppKey("settings", Settings)
COORDINATOR = web.AppKey("coordinator", LifecycleCoordinator)
GATE = web.AppKey("gate", RequestGate)
INFLIGHT = web.AppKey("inflight", InFlightRequests)
FORWARDER = web.AppKey("forwarder", Forwarder)
METRICS = web.AppKey("metrics", Metrics)
ROUTES = web.AppKey("routes", RouteTable)
UNKNOWN_ROUTES = web.AppKey("unknown_routes", UnknownRoutes)
#: Where an engine's proxy is mounted when several engines share this port (`/engines/<name>`).
MOUNT = web.AppKey("mount", str)


def error_parts(error: LifeguardError) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and JSON body of an error the proxy makes itself: the one format, whichever front
    writes it (`render_error` for aiohttp, `render_error_bytes` for the raw front of proxy/front.py)."""
    body = {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.status,
            "reason": error.reason,
            "src": "lifeguard",
            **error.details,
        }
    }
    headers = {"X-Lifeguard-Reason": error.reason}
    if error.status == 503 or error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after or 1)))
    return error.status, headers, json.dumps(body).encode()


def render_error(error: LifeguardError) -> web.Response:
    if isinstance(error, UpstreamRejected):
        # vLLM's own refusal of a lifecycle call: the client sees what vLLM said, as vLLM said it.
        rejected = web.Response(status=error.status, body=error.body, headers={"X-Lifeguard-Reason": error.reason})
        rejected.headers["Content-Type"] = error.content_type or "application/json"
        return rejected
    status, headers, body = error_parts(error)
    response = web.Response(status=status, body=body, headers=headers, content_type=JSON_CONTENT_TYPE, charset="utf-8")
    if error.close_connection:
        response.force_close()
    return response


def render_error_bytes(error: LifeguardError, *, close: bool = False) -> bytes:
    """The whole HTTP/1.1 response of `render_error`, as bytes for a raw transport; `close` (or the error's
    own `close_connection`) adds `Connection: close`."""
    status, headers, body = error_parts(error)
    lines = [f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}", f"Content-Type: {JSON_CONTENT_TYPE}; charset=utf-8"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    if close or error.close_connection:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


JSON_CONTENT_TYPE = "application/json"
_PHRASES = {status.value: status.phrase for status in http.HTTPStatus}


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
        return render_error(LifeguardError("the proxy hit an unexpected error; see its log"))


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[COORDINATOR].snapshot())


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready while we can serve or hold: a sleeping engine keeps the pod ready; a failed, never-started
    or shutting-down one does not."""
    current = request.app[COORDINATOR].state
    ready = current not in (State.FAILED, State.STARTING) and not request.app[GATE].closed
    return web.json_response({"ready": ready, "state": current.value}, status=200 if ready else 503)


async def serving(request: web.Request) -> web.Response:
    """200 while an inference request sent now would be forwarded at once (proxy/serving.py)."""
    if (refusal := engine_refusal(request.app[COORDINATOR], request.app[GATE], request.app[SETTINGS])) is not None:
        raise refusal
    return web.json_response(SERVING)


def _check_admin(request: web.Request, settings: Settings) -> frozenset[str]:
    """Raise unless the admin token (when one is set) came with `request`; returns the header that carried it,
    which is not forwarded to vLLM."""
    if settings.admin_token is None:
        return frozenset()
    expected = settings.admin_token.get_secret_value().encode()
    carrier = "x-lifeguard-token"
    offered = request.headers.get("X-Lifeguard-Token")
    if offered is None:
        auth = request.headers.get("Authorization", "")
        offered = auth[7:] if auth[:7].lower() == "bearer " else None
        carrier = "authorization"
    if offered is None:
        raise Unauthorized("this route needs the admin token (Authorization: Bearer or X-Lifeguard-Token)")
    try:
        offered_bytes = offered.encode()
    except UnicodeEncodeError:  # aiohttp keeps undecodable header bytes as surrogates
        raise Unauthorized("the admin token must be UTF-8 text") from None
    if not hmac.compare_digest(offered_bytes, expected):
        raise Forbidden("the admin token is wrong")
    return frozenset({carrier})


def _admitted_before_body(request: web.Request, settings: Settings) -> frozenset[str]:
    """The admin token is checked before a byte of the body is read: nothing is buffered for a caller without
    it. Refused with its body still on the wire, the connection cannot carry another request."""
    try:
        return _check_admin(request, settings)
    except LifeguardError as exc:
        if request.body_exists:
            exc.close_connection = True
        raise


async def proxy(request: web.Request) -> web.StreamResponse:
    """Every path not under /lifeguard/: its target read once (proxy/target.py), then served by this engine."""
    target = canonical_target(request.raw_path)
    mount = request.app.get(MOUNT)
    if mount is not None:
        target = below_mount(target, mount)
    return await serve_target(request, request.app, target)


async def serve_target(request: web.Request, app: web.Application, target: Target) -> web.StreamResponse:
    """`target` classified, then guarded or forwarded by the engine whose parts are in `app`, with exactly
    the bytes that were classified."""
    started = time.monotonic()
    kind = RouteKind.NEVER_GATED
    try:
        kind = app[ROUTES].classify(request.method, target.path)
        if kind is RouteKind.LIFECYCLE:
            return await _lifecycle(request, app, target)
        guarded = kind not in (RouteKind.INFERENCE, RouteKind.NEVER_GATED)
        dropped = _admitted_before_body(request, app[SETTINGS]) if guarded else frozenset()
        body = await read_body(request, app[SETTINGS])
        if kind is RouteKind.INFERENCE:
            return await _inference(request, app, target, body)
        forward = partial(app[FORWARDER].forward, request, target.raw, body, drop_headers=dropped)
        if kind is RouteKind.AT_ONCE:
            if (refusal := control_refusal(app[COORDINATOR].record.view())) is not None:
                raise refusal
        elif kind is RouteKind.SERIALIZED:
            return await app[COORDINATOR].exclusive(forward)
        elif kind is RouteKind.UNKNOWN:
            app[UNKNOWN_ROUTES].seen(request.method, target.path)
        return await forward()
    finally:
        app[METRICS].request_duration(_ROUTE_CLASS[kind], time.monotonic() - started)


_ROUTE_CLASS = {kind: "passthrough" for kind in RouteKind} | {
    RouteKind.INFERENCE: "inference",
    RouteKind.LIFECYCLE: "lifecycle",
}


async def read_body(request: web.Request, settings: Settings) -> bytes:
    """The whole body, within `max_body_bytes` and `client_body_timeout_s` (read once; later reads are cached)."""
    declared = request.content_length
    if declared is not None and declared > settings.max_body_bytes:
        # Refused before a byte is read; the body is still on the wire, so the connection cannot be reused.
        raise BodyTooLarge(
            f"the request body ({declared} bytes) exceeds the limit of {settings.max_body_bytes} bytes",
            close_connection=True,
        )
    timeout = settings.client_body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None


async def _lifecycle(request: web.Request, app: web.Application, target: Target) -> web.Response:
    op = LIFECYCLE_PATHS[target.path.rstrip("/")]
    try:
        _admitted_before_body(request, app[SETTINGS])
        body = await read_body(request, app[SETTINGS])
        call = parse_call(op, request.query.items(), body)
    except LifeguardError as exc:
        # Refused before the coordinator sees it; still an operation outcome users want on the dashboard.
        app[METRICS].operation_finished(op, "invalid" if exc.status in (400, 413) else "unauthorized", 0.0)
        raise
    return _lifecycle_response(await app[COORDINATOR].submit(call))


def _lifecycle_response(outcome: Outcome) -> web.Response:
    """vLLM's reply (or ours), with what the coordinator decided as `X-Lifeguard-*` headers."""
    response = web.Response(status=outcome.status, body=outcome.body)
    if outcome.content_type:
        response.headers["Content-Type"] = outcome.content_type
    if outcome.verdict is not None:
        response.headers["X-Lifeguard-Verified"] = outcome.verdict.summary()
    if outcome.noop:
        response.headers["X-Lifeguard-Noop"] = "true"
    if outcome.deferred:
        response.headers["X-Lifeguard-Deferred"] = "pause applied on wake"
    if outcome.drained is not None:
        response.headers["X-Lifeguard-Drained"] = outcome.drained
    if outcome.pause_kept is not None:
        response.headers["X-Lifeguard-Pause-Kept"] = outcome.pause_kept
    return response


async def _inference(request: web.Request, app: web.Application, target: Target, body: bytes) -> web.StreamResponse:
    metrics = app[METRICS]
    outcome = "forwarded"
    started = time.monotonic()
    try:
        ticket = await app[GATE].admit(len(body))
    except LifeguardError as exc:
        metrics.inference_finished(exc.reason if exc.reason in GATE_OUTCOMES else "engine_unavailable")
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
            request, lambda entry: forwarder.forward(request, target.raw, body, extra_headers=extra, inflight=entry)
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


GATE_OUTCOMES = frozenset(
    {
        "hold_timeout",
        "hold_queue_full",
        "shutting_down",
        "engine_unavailable",
        "engine_sleeping",
        "insufficient_gpu_memory",
    }
)
_STALE_HEADER = {"X-Lifeguard-Weights-Stale": "true"}
