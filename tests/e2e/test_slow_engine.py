"""A busy vLLM API server answers /health late; that is not an engine death (seen on real vLLM, 2 cores:
a 30 s pause?mode=wait was failed as "engine died" and the engine then taken for restarted; later a RUNNING
engine relaying a 12,000-token stream answered /is_sleeping after more than 10 s, and one such reconcile round
failed it)."""

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
        self.health_calls = 0
        self.late_answers = 0  # the next this many /health calls stall, whatever `slow` says
        self.late_after_pause = 0  # late_answers armed as /pause answers
        self.release = asyncio.Event()
        self.unstall = asyncio.Event()  # a stalled /health answers only when the app shuts down
        self.app = web.Application()
        self.app.on_shutdown.append(self.shutdown)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/is_sleeping", self.flag)
        self.app.router.add_get("/is_paused", self.flag)
        self.app.router.add_post("/pause", self.pause)
        self.app.router.add_post("/resume", self.resume)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completion)
        self.canary_calls = 0
        self.canary_ok = False
        self.streams = 0
        self.end_stream = asyncio.Event()

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        late, self.late_answers = self.late_answers > 0, max(self.late_answers - 1, 0)
        if self.slow or late:
            self.slow_health_calls += 1
            await self.unstall.wait()  # the stall itself: the proxy gives up after control_call_timeout_s
        return web.Response()

    async def shutdown(self, app: web.Application) -> None:
        self.unstall.set()

    async def flag(self, request: web.Request) -> web.Response:
        return web.json_response({request.path.lstrip("/"): self.paused})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("logprobs") == 1 and body.get("max_tokens") == 1:  # the proxy's canary
            self.canary_calls += 1
            if not self.canary_ok:
                return web.json_response({"error": {"message": "not now", "code": 500}}, status=500)
            choice = {"text": " Paris", "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
            return web.json_response({"choices": [choice]})
        self.streams += 1  # a client's stream: one event, then open until the test ends it
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await self.end_stream.wait()
        await stream.write(b"data: [DONE]\n\n")
        return stream

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def pause(self, request: web.Request) -> web.Response:
        self.slow = True
        await self.release.wait()
        self.slow = False
        self.paused = True
        self.late_answers = self.late_after_pause
        return web.json_response({"status": "paused"})


class Guarded:
    """The proxy (late_rounds_before_failed 3) in front of a SlowHealthEngine, once RUNNING."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def state(self) -> dict[str, Any]:
        body: dict[str, Any] = await (await self.client.get("/lifeguard/state")).json()
        return body

    async def until(self, predicate: Any) -> None:
        async with asyncio.timeout(30):  # names a hang; on a loaded 2-core machine rounds of 1 s stretch
            while not predicate():
                await asyncio.sleep(0.02)


async def guard(aiohttp_server: Any, serve_lifeguard: Any, engine: SlowHealthEngine, **settings: Any) -> Guarded:
    server = await aiohttp_server(engine.app)
    config = Settings(
        upstream=str(server.make_url("")).rstrip("/"),
        gpu_probe="none",
        reconcile_interval_s=0.1,
        # Long enough that a healthy /health on a loaded 2-core machine is never late: only a stall is.
        control_call_timeout_s=1.0,
        late_rounds_before_failed=3,
        **{"canary_enabled": False, **settings},
    )
    guarded = Guarded(await serve_lifeguard(config))
    async with asyncio.timeout(30):  # names a start that hangs (a loaded CI machine took over 5 s)
        while (await guarded.state())["state"] != "RUNNING":
            await asyncio.sleep(0.01)
    return guarded


async def test_a_running_engine_late_twice_stays_running(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    engine = SlowHealthEngine()
    guarded = await guard(aiohttp_server, serve_lifeguard, engine)
    engine.late_answers = 2
    calls_before = engine.health_calls
    await guarded.until(lambda: engine.health_calls >= calls_before + 4)  # two late rounds, then two answered

    snapshot = await guarded.state()
    assert snapshot["state"] == "RUNNING" and snapshot["weights_stale"] is False, snapshot
    assert "FAILED" not in [t["to"] for t in snapshot["transitions"]], snapshot["transitions"]
    late = [e for e in snapshot["recent_errors"] if e["reason"] == "engine_late"]
    assert late and "within 1 s" in late[-1]["message"], snapshot["recent_errors"]


async def test_an_engine_silent_for_three_rounds_is_failed(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    engine = SlowHealthEngine()
    guarded = await guard(aiohttp_server, serve_lifeguard, engine)
    engine.late_answers = 10**6
    snapshot: dict[str, Any] = {}

    async def failed() -> None:
        nonlocal snapshot
        async with asyncio.timeout(30):
            while (snapshot := await guarded.state())["state"] != "FAILED":
                await asyncio.sleep(0.02)

    await failed()
    assert snapshot["failure"] == "unreachable", snapshot
    late = [e for e in snapshot["recent_errors"] if e["reason"] == "engine_late"]
    assert late and late[-1]["count"] == 2, snapshot["recent_errors"]  # rounds 1 and 2 passed over, the 3rd failed it
    assert engine.slow_health_calls >= 3


async def test_a_late_answer_to_the_check_after_a_call_is_read_again(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    engine = SlowHealthEngine()
    guarded = await guard(aiohttp_server, serve_lifeguard, engine, verify_timeout_s=0.1)
    engine.late_after_pause = 2  # the check's first reads stall past control_call_timeout_s (and its deadline)
    engine.release.set()

    resp = await guarded.client.post("/pause?mode=wait")
    assert resp.status == 200, await resp.text()
    snapshot = await guarded.state()
    assert snapshot["state"] == "PAUSED" and snapshot["last_verification"]["passed"], snapshot
    assert "FAILED" not in [t["to"] for t in snapshot["transitions"]]


async def test_no_golden_canary_is_sent_while_a_request_is_in_flight(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    """The golden answer is recorded under the coordinator's lock; behind a long stream on real vLLM it took 17 s
    and a trainer's /pause waited for it. It waits for an idle engine instead."""
    engine = SlowHealthEngine()
    guarded = await guard(aiohttp_server, serve_lifeguard, engine, canary_enabled=True)
    await guarded.until(lambda: engine.canary_calls >= 1)  # tried at once, and failed: no golden answer yet
    body = {"model": "tiny", "prompt": "count", "max_tokens": 100, "stream": True}
    async with guarded.client.post("/v1/completions", json=body) as stream:
        assert stream.status == 200
        await stream.content.readline()  # the stream is running: vLLM has it, the proxy relays it
        canaries, health = engine.canary_calls, engine.health_calls
        await guarded.until(lambda: engine.health_calls >= health + 4)  # four reconcile rounds while it runs
        assert engine.canary_calls == canaries
        engine.release.set()
        pause = await guarded.client.post("/pause?mode=keep")  # nothing holds the lock
        assert pause.status == 200, await pause.text()
        assert (await guarded.client.post("/resume")).status == 200
        engine.canary_ok = True
        engine.end_stream.set()
        assert b"[DONE]" in await stream.read()
    await guarded.until(lambda: engine.canary_calls > canaries)  # idle again: the golden answer is recorded


async def test_a_lifecycle_call_outlives_health_checks_that_time_out(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    engine = SlowHealthEngine()
    guarded = await guard(aiohttp_server, serve_lifeguard, engine)
    client, state, until = guarded.client, guarded.state, guarded.until
    call = asyncio.ensure_future(client.post("/pause?mode=wait"))
    await until(lambda: engine.slow_health_calls >= 3)  # the liveness watch and reconcile both timed out
    engine.release.set()

    resp = await call
    assert resp.status == 200, await resp.text()
    snapshot = await state()
    assert snapshot["state"] == "PAUSED" and snapshot["weights_stale"] is False, snapshot
    assert "FAILED" not in [t["to"] for t in snapshot["transitions"]]
