"""The proxy as `vllm-lifeguard serve` runs it, for aiohttp's test client, and the deadline every test
client's request has (tests/conftest.py applies it): shared by every test directory."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import aiohttp
import pytest
from aiohttp.test_utils import BaseTestServer, TestClient
from yarl import URL

from proxy.app import Lifeguard
from proxy.config import Settings


def missing(component: str) -> NoReturn:
    """A component this test needs is not installed. Outside CI: a skip that says so. In CI (CI=true) every group
    installs what its tests need, so a missing component is a failed install, and the test fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{component} (CI=true: a missing component fails, it does not skip)", pytrace=False)
    pytest.skip(f"{component} (outside CI only: CI=true fails here)")


#: The deadline of every request a test client sends unless the test sets its own: well inside pytest's 120 s.
CLIENT_TIMEOUT_S = 60.0


def client_timeout(total: float = CLIENT_TIMEOUT_S) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total)


class LifeguardServer(BaseTestServer):
    """A `Lifeguard` listening on loopback, for aiohttp's TestClient (`client.server.lifeguard`)."""

    def __init__(self, settings: Settings, **lifeguard: Any) -> None:
        super().__init__()
        self.settings = settings
        self.lifeguard = Lifeguard(settings, **lifeguard)

    async def _make_runner(self, **kwargs: Any) -> Any:
        raise NotImplementedError("a Lifeguard runs no aiohttp server")

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        if self.started:
            return
        await self.lifeguard.start(self.host, 0)
        self.port = self.lifeguard.port
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    @property
    def started(self) -> bool:
        return self.lifeguard.engine_set is not None

    async def close(self) -> None:
        if self.started and not self.closed:
            await self.lifeguard.close()
            self._root = None
            self._closed = True


#: `await serve_lifeguard(settings)` (tests/conftest.py): the proxy listening, and a client for it.
ServeLifeguard = Callable[..., Awaitable[TestClient[Any, Any]]]
