"""What every test directory shares: the proxy as `vllm-lifeguard serve` runs it (`serve_lifeguard`), and
clients whose every wait has a deadline shorter than pytest's own (120 s), so that a hang is named, not
hidden."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from lifeguard_testing import LifeguardServer, ServeLifeguard, client_timeout

from proxy.config import Settings


@pytest.fixture
def aiohttp_client(aiohttp_client: Any) -> Callable[..., Awaitable[TestClient[Any, Any]]]:
    """pytest-aiohttp's, with a default deadline on every request (aiohttp's own is 300 s)."""

    async def make(target: Any, **kwargs: Any) -> TestClient[Any, Any]:
        kwargs.setdefault("timeout", client_timeout())
        client: TestClient[Any, Any] = await aiohttp_client(target, **kwargs)
        return client

    return make


@pytest.fixture
def serve_lifeguard(aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]]) -> ServeLifeguard:
    """`await serve_lifeguard(settings)`: the proxy listening, and a client for it (`client.server.lifeguard`)."""

    async def serve(settings: Settings, **lifeguard: Any) -> TestClient[Any, Any]:
        return await aiohttp_client(LifeguardServer(settings, **lifeguard))

    return serve
