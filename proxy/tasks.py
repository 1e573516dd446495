"""`spawn`: the only way this package starts a task.

The event loop keeps only weak references to tasks, so a task nobody holds can be garbage-collected
mid-flight; every task is also named so that a hang shows up readably in a dump.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_running: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    """Start `coro` as a named task and keep a strong reference until it ends."""
    task = asyncio.create_task(coro, name=name)  # noqa: TID251 - this is the wrapper
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task
