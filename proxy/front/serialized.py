"""A control call forwarded once its engine's lifecycle lock is free (`SerializedForward`)."""

from __future__ import annotations

import asyncio

from ..errors import UpstreamTimeout
from ..lifecycle.engine import ControlPlan, Engine
from ..tasks import Tasks
from .answered import Answered
from .exchange import ClientSide, Exchange, Forward
from .request_reader import ParsedRequest


class SerializedForward(Answered):
    """A control call that touches weights or memory (routes.RouteKind.SERIALIZED): forwarded once no
    lifecycle transition of its engine is in progress, never during one; refused while the engine failed. Its
    refusal is answered as `Answered` answers an error; the `Forward` takes over once the engine's lock is held."""

    __slots__ = ("_engine", "_target", "_drop", "_on_answer")

    def __init__(
        self, client: ClientSide, request: ParsedRequest, engine: Engine, target: bytes, plan: ControlPlan, *,
        drop: frozenset[bytes], tasks: Tasks,
    ) -> None:  # fmt: skip
        """`plan`: the engine's `plan_serialized` for this call."""
        metrics = engine.metrics
        super().__init__(
            client,
            request,
            engine.exclusive(self._forwarded, plan),
            tasks=tasks,
            count=metrics.proxy_error,
            on_end=lambda seconds: metrics.request_duration("passthrough", seconds),
        )
        self._engine = engine
        self._target = target
        self._drop = drop
        self._on_answer = plan.on_answer

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
