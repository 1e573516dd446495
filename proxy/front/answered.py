"""What the proxy answers itself on a client connection (`Answered`), and a control call forwarded once its engine's
lifecycle lock is free (`SerializedForward`); the other kinds of exchange are exchange.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import LifeguardError, UpstreamTimeout
from ..lifecycle.engine import Engine
from ..tasks import Tasks
from .boundary import caught
from .exchange import Answering, ClientSide, Exchange, Forward
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


class SerializedForward(Answered):
    """A control call that touches weights or memory (routes.RouteKind.SERIALIZED): forwarded once no
    lifecycle transition of its engine is in progress, never during one; refused while the engine failed. Its
    refusal is answered as `Answered` answers an error; the `Forward` takes over once the engine's lock is held."""

    __slots__ = ("_engine", "_target", "_drop", "_on_answer")

    def __init__(
        self, client: ClientSide, request: ParsedRequest, engine: Engine, target: bytes, *, drop: frozenset[bytes],
        tasks: Tasks, on_answer: Callable[[int, bytes], bytes | None] | None = None, zeroes_weights: bool = False,
    ) -> None:  # fmt: skip
        metrics = engine.metrics
        super().__init__(
            client,
            request,
            engine.coordinator.exclusive(self._forwarded, zeroes_weights=zeroes_weights),
            tasks=tasks,
            count=metrics.proxy_error,
            on_end=lambda seconds: metrics.request_duration("passthrough", seconds),
        )
        self._engine = engine
        self._target = target
        self._drop = drop
        self._on_answer = on_answer

    async def _forwarded(self) -> Exchange:
        """Under the engine's lock: the request goes to vLLM, and the lock is held until its answer ends."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_end() -> None:
            if not ended.done():
                ended.set_result(None)

        forward = Forward(self.client, self.request, self._engine, self._target, drop=self._drop, on_end=on_end,
                          on_answer=self._on_answer)  # fmt: skip
        self.finished = True  # the forward answers from here on
        self.client.replace_exchange(self, forward)
        forward.start()
        timeout = self._engine.settings.lifecycle_call_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(ended)
        except TimeoutError:
            forward.fail(UpstreamTimeout(f"vLLM did not answer within {timeout:g} s"), "upstream_unreachable")
        return forward
