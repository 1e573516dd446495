"""`Tasks`: the only way this package starts a task, one set per proxy.

The event loop keeps only weak references to tasks, so a task nobody holds can be garbage-collected
mid-flight; every task is also named so that a hang shows up readably in a dump, and the proxy's tasks
(lifecycle calls, policy actions, the reconcile loop) are cancelled and awaited when it stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Start `coro` as a named task and keep a strong reference until it ends."""
        task = asyncio.create_task(coro, name=name)  # noqa: TID251 - this is the wrapper
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def close(self) -> None:
        """Cancel every task still running and wait for each to end."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
