"""What a client scenario reads from its stack, in-process (conftest's `Stack`) or as processes
(processes.py's `ProcessStack`): the simulator's and the proxy's state, a wait on either, the clean end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

State = dict[str, Any]


class StackReads:
    """The reads both stacks share; a stack sets `url` (the proxy), `sim_url` and its `get_timeout_s`."""

    url: str
    sim_url: str
    get_timeout_s: float

    def logs(self) -> str:
        """What a failed wait shows after the state (a stack of processes: the tail of their logs)."""
        return ""

    async def get(self, url: str) -> State:
        timeout = aiohttp.ClientTimeout(total=self.get_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            assert response.status == 200, (url, response.status, await response.text())
            body: State = await response.json()
            return body

    async def sim_state(self) -> State:
        return await self.get(f"{self.sim_url}/sim/state")

    async def proxy_state(self) -> State:
        return await self.get(f"{self.url}/lifeguard/state")

    async def wait_for(self, predicate: Callable[[State], bool], what: str, timeout: float = 10.0) -> State:
        """The proxy's state once `predicate` holds for it."""
        return await self._wait(self.proxy_state, predicate, what, timeout)

    async def wait_sim(self, predicate: Callable[[State], bool], what: str, timeout: float = 10.0) -> State:
        """The simulator's state once `predicate` holds for it."""
        return await self._wait(self.sim_state, predicate, what, timeout)

    async def _wait(
        self, read: Callable[[], Awaitable[State]], predicate: Callable[[State], bool], what: str, timeout: float
    ) -> State:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            state = await read()
            if predicate(state):
                return state
            if asyncio.get_running_loop().time() >= deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: {state}\n{self.logs()}")
            await asyncio.sleep(0.02)

    async def assert_clean(self) -> None:
        """The engine never saw a request while not ready; the proxy ends RUNNING with nothing held."""
        state = await self.sim_state()
        assert state["violations"] == [], state["violations"]
        await self.wait_for(lambda s: s["state"] == "RUNNING" and s["held_requests"] == 0, "RUNNING, nothing held")
