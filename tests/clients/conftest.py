"""The stack every client scenario drives: the simulator, the proxy in front of it, both in-process.

The proxy runs with a short `hold_timeout_s`, so a request it holds by mistake (a deadlock in a
trainer's sync) fails within seconds instead of after the default 300 s. After each scenario the
simulator's `/sim/state` must show no violation: the engine never saw a request while not ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.config import Settings
from tests.clients.reads import StackReads
from tests.clients.stand_ins import modules_restored
from tests.lifeguard_testing import CLIENT_TIMEOUT_S, LifeguardServer, without_lifeguard_env

MODEL = "tiny"
HOLD_TIMEOUT_S = 4.0


HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: mark only the ones in this folder.
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.clients)
        # The clients' own code, not ours: SkyRL's _get_session reads aiohttp's deprecated session.loop.
        item.add_marker(pytest.mark.filterwarnings("ignore:client.loop property is deprecated:DeprecationWarning"))


@pytest.fixture(autouse=True)
def _no_lifeguard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    without_lifeguard_env(monkeypatch, keep=frozenset({"LIFEGUARD_CLIENTS_SITE"}))


@pytest.fixture(autouse=True)
def _restore_modules() -> Iterator[None]:
    with modules_restored():
        yield


@dataclass
class Stack(StackReads):
    url: str  # the proxy: what the trainer is pointed at
    sim_url: str
    engine: Engine
    calls: list[str] = field(default_factory=list)  # method and path of every call the proxy received
    sim_calls: list[str] = field(default_factory=list)  # method and path of every call the simulator received
    get_timeout_s: float = CLIENT_TIMEOUT_S

    async def reconciled(self, timeout: float = 10) -> None:
        """Wait for a reconcile round to read the engine's flags: a GET /is_sleeping the simulator receives from
        now on (the check after a lifecycle call ends before the proxy answers it)."""
        seen = len(self.sim_calls)
        deadline = asyncio.get_running_loop().time() + timeout
        while "GET /is_sleeping" not in self.sim_calls[seen:]:
            assert asyncio.get_running_loop().time() < deadline, f"no reconcile round within {timeout} s"
            await asyncio.sleep(0.02)

    def sent(self, *paths: str) -> list[str]:
        """The calls the proxy received whose path is one of `paths`, in order."""
        return [call for call in self.calls if call.split(" ", 1)[1].split("?")[0] in paths]


@pytest.fixture
async def make_stack(aiohttp_server: Any, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    servers: list[LifeguardServer] = []

    async def make(sim: dict[str, Any] | None = None, **proxy: Any) -> Stack:
        gpu_file = tmp_path / "gpu.json"
        sim_settings = {"model": MODEL, "gpu_file": gpu_file, "token_seconds": 0.002, **(sim or {})}
        sim_app = create_sim_app(SimSettings(**sim_settings))
        sim_calls: list[str] = []

        @web.middleware
        async def record_sim_call(request: web.Request, handler: Any) -> web.StreamResponse:
            sim_calls.append(f"{request.method} {request.path}")
            response: web.StreamResponse = await handler(request)
            return response

        sim_app.middlewares.append(record_sim_call)
        sim_server: TestServer = await aiohttp_server(sim_app)
        proxy.setdefault("hold_timeout_s", HOLD_TIMEOUT_S)
        settings = Settings(
            upstream=str(sim_server.make_url("")).rstrip("/"),
            gpu_probe=f"file:{gpu_file}",
            canary_enabled=False,
            **proxy,
        )
        calls: list[str] = []
        proxy_server = LifeguardServer(settings)
        await proxy_server.start_server()
        servers.append(proxy_server)
        router = proxy_server.lifeguard.front.router  # type: ignore[union-attr]
        route = router.route

        def recorded(method: bytes, url: bytes) -> Any:  # every request the proxy reads, as it reads it
            calls.append(f"{method.decode('latin-1')} {url.decode('latin-1')}")
            return route(method, url)

        router.route = recorded  # type: ignore[method-assign]
        stack = Stack(
            str(proxy_server.make_url("")).rstrip("/"),
            str(sim_server.make_url("")).rstrip("/"),
            sim_app[SIM_ENGINE],
            calls,
            sim_calls,
        )
        await stack.wait_for(lambda s: s["state"] == "RUNNING", "the proxy to see the engine")
        return stack

    yield make
    for server in servers:
        await server.close()


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Callable[[str], str]:
    """A LoRA adapter directory as trainers write it (the simulator checks adapter_config.json)."""

    def make(name: str) -> str:
        folder = tmp_path / "lora" / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "peft_type": "LORA"}')
        (folder / "adapter_model.safetensors").write_bytes(b"")
        return str(folder)

    return make
