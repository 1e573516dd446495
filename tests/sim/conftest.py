"""In-process simulators for the simulator's own tests."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from tests.conformance.api import VllmApi

FAST = SimSettings(token_seconds=0.002, sleep_seconds=0.01, wake_seconds=0.01, watchdog_seconds=0.2)


@dataclasses.dataclass
class Sim:
    api: VllmApi
    engine: Engine
    server: Any

    async def state(self) -> dict[str, Any]:
        answer = await self.api.get("/sim/state")
        assert answer.status == 200
        return dict(answer.body)


SimFactory = Callable[..., Awaitable[Sim]]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        yield client


@pytest.fixture
def make_sim(aiohttp_server: Any, session: aiohttp.ClientSession) -> SimFactory:
    """Start a simulator with FAST settings overridden by keyword arguments."""

    async def start(**overrides: Any) -> Sim:
        settings = dataclasses.replace(FAST, **overrides)
        server = await aiohttp_server(create_sim_app(settings))
        api = VllmApi(session, str(server.make_url("")), settings.model)
        return Sim(api, server.app[SIM_ENGINE], server)

    return start


@pytest.fixture
async def sim(make_sim: SimFactory) -> Sim:
    return await make_sim()
