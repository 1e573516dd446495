"""`EngineCalls`: one lifecycle call to vLLM, watched for engine death, and what its failure means.

The coordinator and the weight-update operations send their lifecycle calls through here, under the
coordinator's lock (the one exception: `/update_weights` inside a session, see weight_updates.py). A failed
call leaves vLLM somewhere we did not ask for, so the record adopts what vLLM's flags and the GPUs then say.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..config import Settings
from ..errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from ..tasks import Tasks
from ..upstream.vllm_client import Reply, VllmClient
from .parsed_calls import LifecycleCall
from .record import EngineRecord
from .states import State
from .verifier import Verifier

T = TypeVar("T")


class EngineCalls:
    def __init__(
        self, settings: Settings, client: VllmClient, verifier: Verifier, record: EngineRecord, tasks: Tasks
    ) -> None:
        self._settings = settings
        self._tasks = tasks
        self._client = client
        self._verifier = verifier
        self._record = record

    async def post(self, call: LifecycleCall, path: str, *, hint: State, adopt: bool = True) -> Reply:
        """POST `call` to vLLM's `path`; on failure adopt what vLLM is (`hint`: the state we were near), unless
        `adopt` is False (the caller decides first: sleep_completion.py)."""
        try:
            return await self._watching(self.send(call, path))
        except UpstreamError as exc:
            if adopt:
                await self.adopt_observed(hint, message=exc.message)
            raise

    async def send(self, call: LifecycleCall, path: str) -> Reply:
        """POST `call` to vLLM's `path`, unwatched, with nothing adopted on failure."""
        headers = {"Content-Type": "application/json"} if call.body else None
        return await self._client.lifecycle(
            "POST", path, query=call.query, body=call.body or None,
            timeout_s=self._settings.lifecycle_call_timeout_s, headers=headers,
        )  # fmt: skip

    async def adopt_observed(self, hint: State, *, message: str | None = None) -> None:
        """Re-read what vLLM is (flags and GPU memory) and adopt it."""
        obs = await self._client.observe()
        memory = await self._verifier.read_memory()
        self._record.adopt(obs, hint=hint, message=message, memory_freed=self._verifier.memory_freed(memory))

    async def _watching(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work`, but give up as soon as vLLM's /health says the engine is gone: a utility call in
        flight when the engine dies is never completed by vLLM (#57853), it would hang to its deadline."""
        task = self._tasks.spawn(work, name="lifecycle:upstream")
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._settings.reconcile_interval_s)
                if done:
                    return task.result()
                try:
                    alive = await self._client.health()
                except UpstreamTimeout:
                    # Slow is not dead: a busy API server answered late (real vLLM on 2 cores, a 30 s
                    # pause?mode=wait). Death is a refused connection or a /health that says so.
                    continue
                except UpstreamError:
                    alive = False
                if not alive:
                    raise UpstreamUnreachable("the engine died while the lifecycle call was in flight")
        finally:
            task.cancel()
