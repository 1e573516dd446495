"""What the proxy answers itself on a client connection (`Answered`): an answer of own_answers.py, written once made;
the other kinds of exchange are exchange.py's, held.py's and serialized.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import LifeguardError
from ..tasks import Tasks
from .boundary import caught
from .exchange import Answering, ClientSide, Exchange
from .request_reader import ParsedRequest
from .wire import Answer, error_answer


class Answered(Answering):
    """What the proxy answers itself: `work` makes the answer (a `LifeguardError` is answered as such), or the
    exchange that takes over (a request routed once the engine serving its model is known). `on_end` is
    told the seconds it took, once answered."""

    __slots__ = ("_work", "_tasks", "_count", "_on_end", "_task")

    def __init__(
        self,
        client: ClientSide,
        request: ParsedRequest,
        work: Coroutine[Any, Any, Answer | Exchange],
        *,
        tasks: Tasks,
        count: Callable[[str], None],
        on_end: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__(client, request)
        self._work = work
        self._tasks = tasks
        self._count = count
        self._on_end = on_end
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = self._tasks.spawn(self._run(), name="answer")

    async def _run(self) -> None:
        try:
            result = await self._work
        except LifeguardError as exc:
            result = error_answer(exc)
            self.close_client = self.close_client or exc.close_connection
        except Exception as exc:
            result = error_answer(caught("answer", exc, self._count))
        if self.finished:
            return
        self.finished = True
        if not isinstance(result, Answer):
            self.client.replace_exchange(self, result)
            result.start()
            return
        self._answer(result)
        if self._on_end is not None:
            self._on_end(time.monotonic() - self.request.started)
        self.client.exchange_done(self, close=self.close_client)

    def client_writable(self, writable: bool) -> None:
        return None  # one write, once the answer is made

    def client_gone(self) -> None:
        self.finished = True
        if self._task is not None:
            self._task.cancel()  # a lifecycle call runs on as the coordinator's own task; only the wait ends
        else:
            self._work.close()
