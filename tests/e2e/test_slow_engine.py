"""A busy vLLM API server answers /health late; that is not an engine death (seen on real vLLM, 2 cores:
a 30 s pause?mode=wait was failed as "engine died" and the engine then taken for restarted)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from proxy.config import Settings


class SlowHealthEngine:
    """Just enough of vLLM: /health stalls while `slow`; /pause returns once the test releases it."""

    def __init__(self) -> None:
        self.paused = False
        self.slow = False
        self.slow_health_calls = 0
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/is_sleeping", self.flag)
        self.app.router.add_get("/is_paused", self.flag)
        self.app.router.add_post("/pause", self.pause)

    async def health(self, request: web.Request) -> web.Response:
        if self.slow:
            self.slow_health_calls += 1
            await asyncio.sleep(1.0)  # the stall itself; the proxy gives up after 0.2 s
        return web.Response()

    async def flag(self, request: web.Request) -> web.Response:
        return web.json_response({request.path.lstrip("/"): self.paused})

    async def pause(self, request: web.Request) -> web.Response:
        self.slow = True
        await self.release.wait()
        self.slow = False
        self.paused = True
        return web.json_response({"status": "paused"})


async def test_a_lifecycle_call_outlives_health_checks_that_time_out(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    engine = SlowHealthEngine()
    server = await aiohttp_server(engine.app)
    settings = Settings(
        upstream=str(server.make_url("")).rstrip("/"),
        gpu_probe="none",
        canary_enabled=False,
        reconcile_interval_s=0.1,
        control_call_timeout_s=0.2,
    )
    client = await serve_lifeguard(settings)

    async def state() -> dict[str, Any]:
        body: dict[str, Any] = await (await client.get("/lifeguard/state")).json()
        return body

    async def until(predicate: Any) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                await asyncio.sleep(0.02)

    for _ in range(500):
        if (await state())["state"] == "RUNNING":
            break
        await asyncio.sleep(0.01)
    call = asyncio.ensure_future(client.post("/pause?mode=wait"))
    await until(lambda: engine.slow_health_calls >= 3)  # the liveness watch and reconcile both timed out
    engine.release.set()

    resp = await call
    assert resp.status == 200, await resp.text()
    snapshot = await state()
    assert snapshot["state"] == "PAUSED" and snapshot["weights_stale"] is False, snapshot
    assert "FAILED" not in [t["to"] for t in snapshot["transitions"]]
