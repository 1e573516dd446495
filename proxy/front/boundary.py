"""The one error boundary of the data plane: what an unexpected exception (a bug of ours) becomes.

Every callback of the raw path (the client connection's, an upstream connection's, a held request's, a
timer's, a task answering a request) catches what it did not expect and hands it here: the traceback is
logged once, `lifeguard_proxy_errors_total{where}` counts it, and the client gets this error: 503
`proxy_error` when nothing was answered yet, the same as an SSE error event on a stream already started,
else its connection is dropped (a broken response, never a silently truncated one). Never a 500, never a
hang; the proxy serves on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import LifeguardError

log = logging.getLogger("lifeguard.bug")


def caught(where: str, exc: BaseException, count: Callable[[str], None]) -> LifeguardError:
    """Log and count the bug `exc` caught at `where` (metrics.PROXY_ERROR_PLACES); the error to answer."""
    log.error("unexpected error in the proxy (%s)", where, exc_info=exc, extra={"event": "proxy_error", "where": where})
    count(where)
    return LifeguardError("the proxy hit an unexpected error; see its log")
