"""vLLM 0.34's fault tolerance (`--enable-fault-tolerance`): while `GET /v1/fault_tolerance/status` lists an engine
that is not healthy, vLLM refuses every new request 503 `EngineFaultedError` and its `/health` stays 200.

The refusal itself cannot be told from vLLM's queue-limit 503 but by its message (both are GracefulHTTPErrors with the
type "Service Unavailable"), and upstream/refusals.py never decides by message text. So the status is read each
reconcile round where vLLM serves it: while it says not healthy, the engine holds inference, as it holds vLLM's paused
refusal (and `/lifeguard/serving` says `faulted`), until a `/v1/fault_tolerance/apply` retry makes it healthy. A request
forwarded between the fault and the next round gets vLLM's 503.
"""

from __future__ import annotations

from ..errors import UpstreamError
from ..upstream.vllm_client import VllmClient
from .record import EngineRecord

STATUS_PATH = "/v1/fault_tolerance/status"


class FaultToleranceWatch:
    def __init__(self, client: VllmClient, record: EngineRecord) -> None:
        self._client = client
        self._record = record
        # vLLM answered 404: no fault tolerance here (before 0.34, or not enabled): not asked again.
        self._unserved = False

    async def look(self) -> None:
        """One round: the engine faulted, healthy again, or nothing to read."""
        if self._unserved and self._record.faulted is None:
            return
        try:
            reply = await self._client.call("GET", STATUS_PATH)
            payload = reply.json() if reply.status == 200 else None
        except (UpstreamError, ValueError):
            return  # unreadable this round: what was seen stays
        self._unserved = reply.status == 404
        self._record.fault_seen(_unhealthy(payload))


def _unhealthy(payload: object) -> str | None:
    """What the status says of the first engine that is not healthy (its `fault_info`, else its status)."""
    engines = payload.get("engines") if isinstance(payload, dict) else None
    for entry in engines if isinstance(engines, list) else ():
        if isinstance(entry, dict) and entry.get("status") != "healthy":
            return str(entry.get("fault_info") or entry.get("status"))
    return None
