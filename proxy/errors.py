"""The single exception tree. Each class carries its HTTP status, reason code and Retry-After.

`wire.error_answer` is the one place that turns these into responses; nothing here knows HTTP
libraries. Messages are for people; `reason` is the stable machine-readable code (also sent as the
`X-Lifeguard-Reason` header and used as a metric label). It is a class attribute only, one class per
reason, so the set is closed: `REASONS` lists it.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import aiohttp


class LifeguardError(Exception):
    """Base of every error the proxy answers itself."""

    status = 503
    reason = "proxy_error"
    error_type = "ServiceUnavailableError"
    retry_after: float | None = 1.0
    # The rest of the request may still be on the wire: the connection cannot carry another request.
    close_connection = False
    # Fields added to the error object beside vLLM's own ("state", "cause" ...); empty for most errors.
    details: Mapping[str, Any] = MappingProxyType({})

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        close_connection: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if close_connection is not None:
            self.close_connection = close_connection
        if retry_after is not None:
            self.retry_after = retry_after


class BadParameter(LifeguardError):
    status = 400
    reason = "bad_parameter"
    error_type = "Bad Request"  # vLLM's RequestValidationError answer (serve/exception_handling)
    retry_after = None


class BadTarget(LifeguardError):
    """A request target that two parsers could read as two different paths (proxy/front/target.py)."""

    status = 400
    reason = "bad_request_target"
    error_type = "BadRequestError"
    retry_after = None


class BadRequest(LifeguardError):
    """A request the HTTP/1.1 parser refuses (ambiguous framing, obs-fold, a bad chunk size ...): the
    connection cannot be trusted to carry another request."""

    status = 400
    reason = "bad_request"
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class TargetTooLong(LifeguardError):
    status = 414
    reason = "target_too_long"
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class HeadersTooLarge(LifeguardError):
    status = 431
    reason = "headers_too_large"
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class BodyTooLarge(LifeguardError):
    status = 413
    reason = "body_too_large"
    error_type = "BadRequestError"
    retry_after = None


class BodyTimeout(LifeguardError):
    status = 408
    reason = "body_timeout"
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class Unauthorized(LifeguardError):
    status = 401
    reason = "unauthorized"
    error_type = "AuthenticationError"
    retry_after = None


class Forbidden(LifeguardError):
    status = 403
    reason = "forbidden"
    error_type = "PermissionDeniedError"
    retry_after = None


class InvalidTransition(LifeguardError):
    """The call is not allowed from the state the engine is in (409)."""

    status = 409
    reason = "invalid_transition"
    error_type = "ConflictError"
    retry_after = None


class WeightUpdateInProgress(InvalidTransition):
    reason = "weight_update_in_progress"


class AlreadyAsleep(InvalidTransition):
    reason = "already_asleep"


class EngineAsleep(InvalidTransition):
    reason = "engine_asleep"


class NotPaused(InvalidTransition):
    reason = "not_paused"


class WeightUpdateActive(InvalidTransition):
    reason = "weight_update_active"


class WeightsAsleep(InvalidTransition):
    reason = "weights_asleep"


class NoWeightUpdateSession(InvalidTransition):
    reason = "no_weight_update_session"


class WeightUpdateSessionLost(InvalidTransition):
    reason = "weight_update_session_lost"


class EngineNotChosen(LifeguardError):
    """Several engines are guarded and the request does not say which one it is for."""

    status = 400
    reason = "engine_not_chosen"
    error_type = "BadRequestError"
    retry_after = None


class UnknownEngine(LifeguardError):
    """`/engines/<name>/...` names no configured engine."""

    status = 404
    reason = "unknown_engine"
    error_type = "NotFoundError"
    retry_after = None


class ModelNotFound(LifeguardError):
    """No guarded engine serves the requested model: vLLM's own answer (serving_engine's model check)."""

    status = 404
    reason = "model_not_found"
    error_type = "NotFoundError"
    retry_after = None

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class NotFound(LifeguardError):
    """A path under the proxy's own `/lifeguard/` that it does not serve."""

    status = 404
    reason = "not_found"
    error_type = "NotFoundError"
    retry_after = None


class MethodNotAllowed(LifeguardError):
    status = 405
    reason = "method_not_allowed"
    error_type = "BadRequestError"
    retry_after = None


class InsufficientGpuMemory(LifeguardError):
    """Waking the engine would not fit in its GPUs' free memory, even after putting others to sleep."""

    reason = "insufficient_gpu_memory"
    retry_after = 10.0


class GpuLockUnavailable(LifeguardError):
    """The node's lock of a GPU (gpu_lock_dir) cannot be taken: its UUID is not known yet, or the lock
    directory cannot be used. Nothing that takes GPU memory runs without it."""

    reason = "gpu_lock_unavailable"
    retry_after = 5.0


class LifecycleBusy(LifeguardError):
    status = 409
    reason = "lifecycle_busy"
    error_type = "ConflictError"
    retry_after = 5.0


class HoldTimeout(LifeguardError):
    reason = "hold_timeout"


class HoldQueueFull(LifeguardError):
    reason = "hold_queue_full"


class ShuttingDown(LifeguardError):
    reason = "shutting_down"


class EngineUnavailable(LifeguardError):
    reason = "engine_unavailable"
    retry_after = 5.0


class EngineScaling(LifeguardError):
    """vLLM's elastic-EP gate is up while the deployment scales: a lifecycle call waits for it to end."""

    reason = "engine_scaling"
    retry_after = 5.0


class EngineRetired(LifeguardError):
    """An elastic-EP scale-down retired this data-parallel rank: nothing will be served here again."""

    reason = "engine_retired"
    retry_after = 1.0


class EngineSleeping(LifeguardError):
    reason = "engine_sleeping"
    retry_after = 5.0


class NotServing(LifeguardError):
    """`/lifeguard/serving`: an inference request sent now would not be forwarded at once (held or refused)."""

    reason = "not_serving"

    def __init__(self, message: str, **details: Any) -> None:
        """`details`: one engine's `state` and `cause` (rules.serving_refusal), or every engine's (`engines`)."""
        super().__init__(message)
        self.details = MappingProxyType(details)


class UpstreamError(LifeguardError):
    """vLLM failed, or could not be reached, while we called it."""

    reason = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    reason = "upstream_unreachable"


class UpstreamTimeout(UpstreamError, TimeoutError):
    reason = "upstream_timeout"


class StreamBroken(UpstreamError):
    """vLLM's answer broke off after it had begun: the stream ends with this error."""

    reason = "stream_broken"


class AbortedBySleep(LifeguardError):
    """A forwarded request ended by the proxy because the engine discarded its weights (proxy/lifecycle/inflight.py)."""

    reason = "aborted_by_sleep"
    retry_after = 5.0


class UpstreamBadStatus(UpstreamError):
    """vLLM answered a lifecycle call with a non-2xx status; its message is kept."""

    reason = "upstream_error"

    def __init__(self, message: str, *, upstream_status: int, upstream_body: str) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        self.upstream_body = upstream_body


class UpstreamRejected(UpstreamBadStatus):
    """vLLM refused a lifecycle call with a 4xx (a bad body, say): relayed to the client as vLLM said it."""

    reason = "upstream_rejected"
    retry_after = None

    def __init__(self, message: str, *, upstream_status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(message, upstream_status=upstream_status, upstream_body=body.decode(errors="replace")[:2000])
        self.status = upstream_status
        self.body = body
        self.content_type = content_type


class VerificationFailed(LifeguardError):
    """vLLM said 200, but the engine did not reach the state the call promised (a "200 lie")."""

    reason = "verification_failed"

    def __init__(self, message: str, *, check: str, verification: str | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.verification = verification  # every check's result, as in X-Lifeguard-Verified


def _reasons(cls: type[LifeguardError]) -> set[str]:
    found = {cls.reason}
    for sub in cls.__subclasses__():
        found |= _reasons(sub)
    return found


#: Every reason the proxy can answer with (X-Lifeguard-Reason), besides vLLM's own relayed refusals.
REASONS: frozenset[str] = frozenset(_reasons(LifeguardError))


def transport_failure(exc: BaseException, address: str) -> str:
    """What went wrong talking to vLLM at `address` (host:port), as a person would say it, never a library's repr:
    `connection refused by 127.0.0.1:8000`."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        address, exc = f"{exc.host}:{exc.port}", exc.os_error
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused by {address}"
    if isinstance(exc, ConnectionResetError):
        return f"connection reset by {address}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{address} closed the connection before answering"
    if isinstance(exc, socket.gaierror):
        return f"the host of {address} could not be resolved ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror[:1].lower()}{exc.strerror[1:]} ({address})"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"the answer from {address} broke off"
    text = str(exc)
    return f"{text} ({address})" if text else f"{type(exc).__name__} talking to {address}"
