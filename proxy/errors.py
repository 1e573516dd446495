"""The single exception tree. Each class carries its HTTP status, reason code and Retry-After.

`wire.error_answer` is the one place that turns these into responses; nothing here knows HTTP
libraries. Messages are for people; `reason` is the stable machine-readable code (also sent as the
`X-Lifeguard-Reason` header and used as a metric label). It is a class attribute only, one class per
reason, so the set is closed: `REASONS` lists it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class LifeguardError(Exception):
    """Base of every error the proxy answers itself."""

    status = 503
    reason = "proxy_error"
    advice = "Retry; report the logged traceback (it is a bug of the proxy). The proxy keeps serving."
    error_type = "ServiceUnavailableError"
    retry_after: float | None = 1.0
    # The rest of the request may still be on the wire: the connection cannot carry another request.
    close_connection = False
    # Fields added to the error object beside vLLM's own ("state", "cause" ...); empty for most errors.
    details: Mapping[str, Any] = MappingProxyType({})
    #: What a client or an operator can do about it (docs/reference/errors.md); each class with a reason of its own
    #: says its own.
    advice = "Retry; report the logged traceback (it is a bug of the proxy). The proxy keeps serving."

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
    """A lifecycle call's query parameter or body failed validation (`param` names it); nothing was sent to vLLM."""

    status = 400
    reason = "bad_parameter"
    advice = "Fix the parameter named in `param` (vLLM's own validation rules; docs/openapi.yaml)."
    error_type = "Bad Request"  # vLLM's RequestValidationError answer (serve/exception_handling)
    retry_after = None


class BadTarget(LifeguardError):
    """A request target that two parsers could read as two different paths (proxy/front/target.py)."""

    status = 400
    reason = "bad_request_target"
    advice = (
        "Send the path plainly: no encoded slashes, dot segments or backslashes that two parsers could read "
        "differently."
    )
    error_type = "BadRequestError"
    retry_after = None


class BadRequest(LifeguardError):
    """A request the HTTP/1.1 parser refuses (ambiguous framing, obs-fold, a bad chunk size ...): the
    connection cannot be trusted to carry another request."""

    status = 400
    reason = "bad_request"
    advice = "Fix the client's HTTP framing (one Content-Length or chunked, no obs-fold); the connection is closed."
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class TargetTooLong(LifeguardError):
    """The request target (path and query) is longer than the front accepts."""

    status = 414
    reason = "target_too_long"
    advice = "Shorten the URL; put parameters in the body."
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class HeadersTooLarge(LifeguardError):
    """The request's headers are larger than the front accepts."""

    status = 431
    reason = "headers_too_large"
    advice = "Send fewer or smaller headers."
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class BodyTooLarge(LifeguardError):
    """The request body is larger than `max_body_bytes` (a weight push's: `max_weight_update_body_bytes`)."""

    status = 413
    reason = "body_too_large"
    advice = (
        "Raise `max_body_bytes` (or `max_weight_update_body_bytes` for weight pushes), within the container's memory."
    )
    error_type = "BadRequestError"
    retry_after = None


class BodyTimeout(LifeguardError):
    """The whole body did not arrive within `client_body_timeout_s` of the headers."""

    status = 408
    reason = "body_timeout"
    advice = "Send the body promptly, or raise `client_body_timeout_s`."
    error_type = "BadRequestError"
    retry_after = None
    close_connection = True


class Unauthorized(LifeguardError):
    """`admin_token` is set and the request carried no token (lifecycle, control and unknown routes,
    `/lifeguard/state`, the status page)."""

    status = 401
    reason = "unauthorized"
    advice = "Send the token as `Authorization: Bearer <token>` or `X-Lifeguard-Token`."
    error_type = "AuthenticationError"
    retry_after = None


class Forbidden(LifeguardError):
    """The admin token the request carried is wrong."""

    status = 403
    reason = "forbidden"
    advice = "Send the proxy's `admin_token` (LIFEGUARD_ADMIN_TOKEN), not vLLM's API key."
    error_type = "PermissionDeniedError"
    retry_after = None


class InvalidTransition(LifeguardError):
    """The call is not allowed from the state the engine is in (409)."""

    status = 409
    reason = "invalid_transition"
    advice = "Read the engine's state (`/lifeguard/state`) and send the call that state allows."
    error_type = "ConflictError"
    retry_after = None


class WeightUpdateInProgress(InvalidTransition):
    """A weight update is in progress: the call (a sleep, a pause ...) must wait for it to finish."""

    reason = "weight_update_in_progress"
    advice = "Finish the update (/finish_weight_update), then retry."


class AlreadyAsleep(InvalidTransition):
    """The engine is asleep already: this sleep cannot be applied on top of the one it is in."""

    reason = "already_asleep"
    advice = "Wake it first (/wake_up), or leave it asleep."


class EngineAsleep(InvalidTransition):
    """The engine is asleep: the call needs it awake."""

    reason = "engine_asleep"
    advice = "Wake it first (/wake_up), then retry."


class NotPaused(InvalidTransition):
    """The call needs a completed pause (`/release_kv_cache_memory`, SkyRL's sleep for a weight sync)."""

    reason = "not_paused"
    advice = "Pause first (`/pause`, `mode=keep` for SkyRL's weight sync), then retry."


class WeightUpdateActive(InvalidTransition):
    """A weight update session is open already: a second one cannot start."""

    reason = "weight_update_active"
    advice = "Finish the session (/finish_weight_update), then retry."


class WeightsAsleep(InvalidTransition):
    """The weights are asleep (offloaded or discarded): a call that writes them (a weight update, a weight-writing
    `/collective_rpc`) is refused until they are woken."""

    reason = "weights_asleep"
    advice = "Wake the weights (`/wake_up?tags=weights`), then retry."


class NoWeightUpdateSession(InvalidTransition):
    """/update_weights or /finish_weight_update with no session open (/start_weight_update first)."""

    reason = "no_weight_update_session"
    advice = "Open a session with /start_weight_update first."


class WeightUpdateSessionLost(InvalidTransition):
    """The weight update session the call belongs to was lost (vLLM restarted, or the proxy did with no state file)."""

    reason = "weight_update_session_lost"
    advice = "Start the weight update again from /start_weight_update."


class CheckpointPrepared(InvalidTransition):
    """The engine is prepared for a process checkpoint (vLLM 0.34's `/checkpoint/prepare`): vLLM answers the call 500
    until a restore, so the proxy refuses it."""

    reason = "checkpoint_prepared"
    advice = "Restore the engine (`POST /checkpoint/restore`), then retry."


class WeightsPartial(InvalidTransition):
    """An /update_weights failed mid-way: the weights are partial and no label may be published onto them."""

    reason = "weights_partial"
    advice = (
        "A chunk of the weight update failed and left the weights partial: start a new weight update session "
        "(or reload the weights); inference is held until then."
    )


class EngineNotChosen(LifeguardError):
    """Several engines are guarded and the request does not say which one it is for."""

    status = 400
    reason = "engine_not_chosen"
    advice = (
        "Send it to one engine's base URL, `/engines/<name>/...` (the message lists them), or name a served model in "
        "the body."
    )
    error_type = "BadRequestError"
    retry_after = None


class UnknownEngine(LifeguardError):
    """`/engines/<name>/...` names no configured engine."""

    status = 404
    reason = "unknown_engine"
    advice = "Use one of the engine names in the message (the `engines:` setting)."
    error_type = "NotFoundError"
    retry_after = None


class ModelNotFound(LifeguardError):
    """No guarded engine serves the requested model: vLLM's own answer (serving_engine's model check)."""

    status = 404
    reason = "model_not_found"
    advice = "Use a model one of the engines serves (`GET /v1/models`), or list it in that engine's `models:`."
    error_type = "NotFoundError"
    retry_after = None

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class NotFound(LifeguardError):
    """A path under the proxy's own `/lifeguard/` that it does not serve."""

    status = 404
    reason = "not_found"
    advice = "Use one of the proxy's own routes (docs/reference/routes.md)."
    error_type = "NotFoundError"
    retry_after = None


class MethodNotAllowed(LifeguardError):
    """A method one of the proxy's own routes does not answer (they answer GET)."""

    status = 405
    reason = "method_not_allowed"
    advice = "Use GET (the status page also takes its sign-in form's POST)."
    error_type = "BadRequestError"
    retry_after = None


class InsufficientGpuMemory(LifeguardError):
    """Waking the engine would not fit in its GPUs' free memory, even after putting others to sleep."""

    reason = "insufficient_gpu_memory"
    advice = (
        "Retry after Retry-After; free GPU memory (put an engine to sleep, unpin one), or set `footprint_gib` to what"
        " the engine really takes."
    )
    retry_after = 10.0


class GpuLockUnavailable(LifeguardError):
    """The node's lock of a GPU (gpu_lock_dir) cannot be taken: its UUID is not known yet, or the lock
    directory cannot be used. Nothing that takes GPU memory runs without it."""

    reason = "gpu_lock_unavailable"
    advice = (
        "Make `gpu_lock_dir` a writable directory shared by the node's lifeguards, and let the proxy read the GPUs' "
        "UUIDs (`gpu_probe` nvml or file:, or `gpu_devices`)."
    )
    retry_after = 5.0


class LifecycleBusy(LifeguardError):
    """The call waited its turn behind another lifecycle call past `lifecycle_queue_timeout_s`."""

    status = 409
    reason = "lifecycle_busy"
    advice = (
        "Retry after Retry-After, or raise `lifecycle_queue_timeout_s`; do not send lifecycle calls for one engine "
        "from several clients at once."
    )
    error_type = "ConflictError"
    retry_after = 5.0


class HoldTimeout(LifeguardError):
    """A held inference request waited `hold_timeout_s` and the engine did not become ready to serve it."""

    reason = "hold_timeout"
    advice = (
        "Find why the engine is not ready (`/lifeguard/state`: asleep, paused, weights stale, FAILED) and wake or "
        "resume it; raise `hold_timeout_s` above your longest training step."
    )


class HoldQueueFull(LifeguardError):
    """`max_held_requests` requests (or `max_held_bytes` of bodies) are held already."""

    reason = "hold_queue_full"
    advice = "Retry later; raise `max_held_requests` or `max_held_bytes` within the container's memory."


class ShuttingDown(LifeguardError):
    """The proxy is shutting down: held and new requests are refused."""

    reason = "shutting_down"
    advice = "Retry against another replica, or after the restart."


class EngineUnavailable(LifeguardError):
    """The engine is FAILED (vLLM gone or not answering), or not started yet."""

    reason = "engine_unavailable"
    advice = "Check vLLM (its logs, `/health`); the proxy serves again once its reconcile sees vLLM back."
    retry_after = 5.0


class EngineScaling(LifeguardError):
    """vLLM's elastic-EP gate is up while the deployment scales: a lifecycle call waits for it to end."""

    reason = "engine_scaling"
    advice = "Retry after the scaling ends (Retry-After)."
    retry_after = 5.0


class EngineRetired(LifeguardError):
    """An elastic-EP scale-down retired this data-parallel rank: nothing will be served here again."""

    reason = "engine_retired"
    advice = "Send to another data-parallel rank: this one will serve nothing again."
    retry_after = 1.0


class EngineSleeping(LifeguardError):
    """The engine sleeps and `on_sleeping` is `reject`."""

    reason = "engine_sleeping"
    advice = "Wake the engine (/wake_up), or set `on_sleeping` to `hold` or `wake`."
    retry_after = 5.0


class NotServing(LifeguardError):
    """`/lifeguard/serving`: an inference request sent now would not be forwarded at once (held or refused)."""

    reason = "not_serving"
    advice = (
        "Nothing, for a router: send elsewhere until it answers 200. The body's `cause` says why (asleep, paused, "
        "weights_stale ...)."
    )

    def __init__(self, message: str, **details: Any) -> None:
        """`details`: one engine's `state` and `cause` (rules.serving_refusal), or every engine's (`engines`)."""
        super().__init__(message)
        self.details = MappingProxyType(details)


class UpstreamError(LifeguardError):
    """vLLM failed, or could not be reached, while we called it."""

    reason = "upstream_error"
    advice = "Check vLLM's logs; retry."
    #: How vLLM could not be reached, in words (refused, DNS, TLS, no answer in time); None when it answered.
    why: str | None = None


class UpstreamUnreachable(UpstreamError):
    """vLLM could not be reached (connection refused, reset or unresolvable)."""

    reason = "upstream_unreachable"
    advice = "Check that vLLM runs and `upstream` points at it."


class UpstreamTimeout(UpstreamError, TimeoutError):
    """vLLM did not answer within the call's deadline (`lifecycle_call_timeout_s`, `control_call_timeout_s`)."""

    reason = "upstream_timeout"
    advice = "Check vLLM's load; raise the deadline if the call is legitimately slow."


class StreamBroken(UpstreamError):
    """vLLM's answer broke off after it had begun: the stream ends with this error."""

    reason = "stream_broken"
    advice = "Retry the request; check vLLM's logs for why its answer broke off."


class AbortedBySleep(LifeguardError):
    """A forwarded request ended by the proxy because the engine discarded its weights (proxy/lifecycle/inflight.py)."""

    reason = "aborted_by_sleep"
    advice = "Retry after the wake; sleep at level 1 or drain first (`drain_before_sleep_s`) to let requests finish."
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
    advice = "Fix the call as vLLM's message says."
    retry_after = None

    def __init__(self, message: str, *, upstream_status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(message, upstream_status=upstream_status, upstream_body=body.decode(errors="replace")[:2000])
        self.status = upstream_status
        self.body = body
        self.content_type = content_type


class VerificationFailed(LifeguardError):
    """vLLM said 200, but the engine did not reach the state the call promised (a "200 lie")."""

    reason = "verification_failed"
    advice = (
        'The engine did not reach the state vLLM claimed (a "200 lie"): read `/lifeguard/state`\'s last verification; '
        "wake or restart vLLM. See docs/verification.md."
    )

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
