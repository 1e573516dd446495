"""`InFlightRequests`: the inference requests the proxy has sent to vLLM and not yet seen answered, each
with a handle to end it.

Why: after a level-2 sleep vLLM holds no valid weights, yet it still queues a request that was on its way
when the sleep began (or frozen by `mode=keep`) and runs it right after the wake, on discarded weights:
a 200 with garbage. The proxy knows every such request, so it ends them once the weights are gone, before
any wake is sent: the upstream connection is closed (vLLM aborts a request whose client went away) and
the client gets 503 `aborted_by_sleep`, or, on a stream that already started, the same error as an SSE
event and then the end of the stream. `abort_all` is the entry point for any call after which the weights
vLLM holds are not those a queued request was sent for (a level-2 sleep today).

Entries of the aiohttp path: `asyncio.timeout(None)` rescheduled to now: it cancels the forwarding task at its
current await and turns that into a `TimeoutError` at the block's end, without taking a cancellation
that belongs to aiohttp (a client that left) for ours. Entries of the raw front (proxy/relays.py) end
themselves synchronously in `abort`; both kinds are `Abortable`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from .errors import LifeguardError

log = logging.getLogger("lifeguard.inflight")
# Set on a request whose started stream was ended by an abort (its status was already sent as 200).
STREAM_ABORTED = web.RequestKey("stream_aborted", bool)

# An aborted request unwinds at its next await; this bounds the wait for every connection to be closed.
_UNWIND_S = 2.0


class AbortedBySleep(LifeguardError):
    reason = "aborted_by_sleep"
    retry_after = 5.0


class Abortable(Protocol):
    def abort(self, message: str) -> bool:
        """End the request (its upstream connection closed, its client answered); False when there was
        nothing left to end."""
        ...

    async def wait_ended(self) -> None: ...


class InFlight:
    """One forwarded request. The forwarder reports when the upstream answer is complete (nothing of it
    depends on vLLM's weights any more) and which stream response it started."""

    __slots__ = ("_timeout", "_ended", "aborted", "upstream_done", "response", "is_sse")

    def __init__(self, timeout: asyncio.Timeout) -> None:
        self._timeout = timeout
        self._ended = asyncio.Event()
        self.aborted: str | None = None
        self.upstream_done = False
        self.response: web.StreamResponse | None = None
        self.is_sse = False

    def started_stream(self, response: web.StreamResponse, *, is_sse: bool) -> None:
        self.response, self.is_sse = response, is_sse

    def finished_upstream(self) -> None:
        self.upstream_done = True

    def abort(self, message: str) -> bool:
        if self.upstream_done or self.aborted is not None or self._ended.is_set():
            return False
        self.aborted = message
        self._timeout.reschedule(asyncio.get_running_loop().time())
        return True

    async def wait_ended(self) -> None:
        await self._ended.wait()


class InFlightRequests:
    def __init__(self) -> None:
        self._entries: set[Abortable] = set()
        self._aborting: list[Abortable] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Abortable) -> None:
        """A request forwarded by the raw front; it calls `discard` when it ends."""
        self._entries.add(entry)

    def discard(self, entry: Abortable) -> None:
        self._entries.discard(entry)

    async def run(
        self, request: web.Request, send: Callable[[InFlight], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """`send(entry)` forwards the request; raises `AbortedBySleep` when the request was ended before its
        answer began, and ends a started stream with the error."""
        entry: InFlight | None = None
        try:
            async with asyncio.timeout(None) as timeout:
                entry = InFlight(timeout)
                self._entries.add(entry)
                try:
                    return await send(entry)
                finally:
                    self._entries.discard(entry)
                    entry._ended.set()
        except TimeoutError:
            if entry is None or entry.aborted is None:
                raise
        error = AbortedBySleep(entry.aborted)
        if entry.response is None:
            raise error
        request[STREAM_ABORTED] = True
        return await _end_stream(request, entry.response, error, is_sse=entry.is_sse)

    def abort_all(self, message: str) -> int:
        """End every request still waiting on vLLM (each unwinds at its next await); `wait_aborted` returns
        once their upstream connections are closed."""
        aborted = [entry for entry in list(self._entries) if entry.abort(message)]
        if aborted:
            self._aborting.extend(aborted)
            log.warning("ended %d forwarded requests: %s", len(aborted), message, extra={"event": "inflight_aborted"})
        return len(aborted)

    async def wait_aborted(self) -> None:
        """Called before the next lifecycle call may reach vLLM (a wake must find those requests gone)."""
        pending, self._aborting = self._aborting, []
        if not pending:
            return
        try:
            async with asyncio.timeout(_UNWIND_S):
                await asyncio.gather(*(entry.wait_ended() for entry in pending))
        except TimeoutError:
            log.warning("aborted requests did not unwind within %g s", _UNWIND_S)


def sse_abort_event(error: LifeguardError) -> bytes:
    payload = {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": None,
            "code": error.status,
            "reason": error.reason,
            "src": "lifeguard",
        }
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _end_stream(
    request: web.Request, response: web.StreamResponse, error: LifeguardError, *, is_sse: bool
) -> web.StreamResponse:
    """An SSE error event and the end of the stream; a stream of another type cannot carry an error, so its
    connection is dropped (the client sees a broken response, never a silently truncated one)."""
    try:
        if is_sse:
            await response.write(sse_abort_event(error))
            await response.write_eof()
        else:
            response.force_close()
            if request.transport is not None:
                request.transport.abort()
    except (ConnectionResetError, OSError):
        log.debug("client left while its aborted stream was ended")
    return response
