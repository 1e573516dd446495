"""A `/sleep` that answered 500 after its memory was freed is completed, not rolled back.

vLLM's `Worker.sleep` asserts that the card's free memory did not shrink while it slept, with no grace: a neighbour
allocating on a shared GPU trips it after the pools were freed (vLLM 0.33 and 0.34 alike). `Executor.sleep` records its
sleeping tags only after the call returns, so `/is_sleeping` says true while the executor counts itself awake: the
next `/wake_up` is a no-op and scheduling resumes onto unmapped weights. Where the engine's own memory fell as a sleep's
does (NVML per process), the sleep is sent again, as AIBrix 0.8.0's runtime does (`runtime/model_runtime.py`, three
tries), which records the tags; otherwise what vLLM really is is read and kept, as for any failed call.
"""

from __future__ import annotations

import logging

from ..errors import UpstreamBadStatus, UpstreamError, UpstreamRejected
from ..upstream.vllm_client import Reply
from .engine_calls import EngineCalls
from .parsed_calls import LifecycleCall
from .states import State
from .verifier import Verifier

log = logging.getLogger("lifeguard.lifecycle")

#: Sends of a sleep whose 500 came after its memory was freed, as AIBrix 0.8.0 re-sends it.
SLEEP_RESENDS = 3


async def sleep_sent(calls: EngineCalls, verifier: Verifier, call: LifecycleCall, *, hint: State) -> Reply:
    """POST `call` to `/sleep`; a 500 after the memory was freed sends it again (at most SLEEP_RESENDS times)."""
    failure: UpstreamError | None = None
    for attempt in range(1 + SLEEP_RESENDS):
        try:
            return await calls.post(call, "/sleep", hint=hint, adopt=False)
        except UpstreamError as exc:
            failure = exc
        if not _failed_after_freeing(failure, call) or attempt == SLEEP_RESENDS:
            break
        freed = verifier.memory_freed(await verifier.read_memory())
        if freed is not True:
            break
        log.warning(
            "vLLM answered /sleep %s after its memory was freed (a neighbour allocating on the GPU trips vLLM's "
            "check); sent again to complete it (%d of %d)",
            failure.upstream_status if isinstance(failure, UpstreamBadStatus) else "an error",
            attempt + 1,
            SLEEP_RESENDS,
            extra={"event": "sleep_completed_after_500", "attempt": attempt + 1},
        )
    assert failure is not None
    await calls.adopt_observed(hint, message=failure.message)
    raise failure


def _failed_after_freeing(failure: UpstreamError, call: LifecycleCall) -> bool:
    """A 5xx to a sleep that frees memory (level >= 1): what vLLM's assertion answers."""
    status = getattr(failure, "upstream_status", None)
    return (
        isinstance(failure, UpstreamBadStatus)
        and not isinstance(failure, UpstreamRejected)
        and isinstance(status, int)
        and status >= 500
        and (call.level is None or call.level >= 1)
    )
