"""Transparent forwarding: what the proxy does not guard reaches vLLM and comes back unchanged."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from aiohttp import web

from proxy.config import Settings

# The stand-in's streaming routes, declared inference so that the raw front forwards them itself.
STREAM_ROUTES = ["/v1/stream", "/v1/broken", "/v1/wait_for_disconnect"]


class EchoUpstream:
    """A vLLM stand-in that records what it received and lets a test pace its streams."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.release_chunk = asyncio.Event()
        self.stream_closed = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/health", self.flag(None))
        self.app.router.add_get("/is_sleeping", self.flag("is_sleeping"))
        self.app.router.add_get("/is_paused", self.flag("is_paused"))
        self.app.router.add_post("/v1/stream", self.stream)
        self.app.router.add_post("/v1/broken", self.broken)
        self.app.router.add_post("/v1/wait_for_disconnect", self.wait_for_disconnect)
        self.app.router.add_route("*", "/{tail:.*}", self.echo)

    @staticmethod
    def flag(name: str | None) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response({name: False}) if name else web.Response()

        return handler

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(
            {
                "method": request.method,
                "path": request.raw_path,
                "headers": dict(request.headers),
                "query": list(request.query.items()),
                "body": body,
            }
        )
        if request.path == "/empty":
            return web.Response(status=200)
        return web.json_response({"echo": body.decode()}, status=201, headers={"X-Upstream": "yes"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await self.release_chunk.wait()  # the second chunk only after the client has seen the first
        await resp.write(b"data: second\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def broken(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def wait_for_disconnect(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(2000):
                await resp.write(b"data: tick\n\n")
                await asyncio.sleep(0.005)  # pacing of the fake generation, not synchronisation
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_closed.set()
            raise
        return resp


@pytest.fixture
async def echo(aiohttp_server: Any) -> Any:
    upstream = EchoUpstream()
    server = await aiohttp_server(upstream.app)
    return upstream, server


@pytest.fixture
async def client(echo: Any, serve_lifeguard: Any) -> Any:
    upstream, server = echo
    settings = Settings(
        upstream=str(server.make_url("")).rstrip("/"),
        gpu_probe="none",
        max_body_bytes=1024,
        routes={"inference": STREAM_ROUTES},
    )
    proxy_client = await serve_lifeguard(settings)
    for _ in range(500):
        if (await (await proxy_client.get("/lifeguard/state")).json())["state"] == "RUNNING":
            break
        await asyncio.sleep(0.01)
    return proxy_client


async def test_status_body_and_headers_come_back_unchanged(client: Any, echo: Any) -> None:
    resp = await client.post("/v1/anything", data=b"payload", headers={"Content-Type": "text/plain"})
    assert resp.status == 201
    assert resp.headers["X-Upstream"] == "yes"
    assert await resp.json() == {"echo": "payload"}


async def test_an_empty_200_stays_empty_without_a_content_type(client: Any) -> None:
    resp = await client.get("/empty")
    assert resp.status == 200
    assert await resp.read() == b""
    assert "Content-Type" not in resp.headers
    assert resp.headers["Content-Length"] == "0"


async def test_auth_session_and_rank_headers_pass_and_no_forwarded_for_is_added(client: Any, echo: Any) -> None:
    upstream, _ = echo
    headers = {"Authorization": "Bearer k", "X-Session-ID": "s1", "X-data-parallel-rank": "3", "Connection": "close"}
    await client.post("/v1/completions", json={}, headers=headers)
    seen = upstream.seen[-1]["headers"]
    assert seen["Authorization"] == "Bearer k"
    assert seen["X-Session-ID"] == "s1"
    assert seen["X-data-parallel-rank"] == "3"
    assert "X-Forwarded-For" not in seen
    assert seen.get("Connection", "").lower() != "close"  # hop-by-hop: ours, not the client's


async def test_trailing_slash_repeated_query_and_get_with_body_are_kept(client: Any, echo: Any) -> None:
    upstream, _ = echo
    await client.request("GET", "/get_world_size/?a=1&a=2&flag=false", data=b'{"x": 1}')
    seen = upstream.seen[-1]
    assert seen["path"] == "/get_world_size/?a=1&a=2&flag=false"
    assert seen["query"] == [("a", "1"), ("a", "2"), ("flag", "false")]
    assert seen["body"] == b'{"x": 1}'


async def test_sse_is_relayed_chunk_by_chunk_as_it_arrives(client: Any, echo: Any) -> None:
    upstream, _ = echo
    resp = await client.post("/v1/stream", json={})
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert first == b"data: first\n\n"  # arrived while the upstream still holds the rest back
    upstream.release_chunk.set()
    rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest == b"data: second\n\ndata: [DONE]\n\n"


async def test_a_stream_that_breaks_mid_way_ends_with_an_error_event(client: Any) -> None:
    resp = await client.post("/v1/broken", json={})
    body = await asyncio.wait_for(resp.content.read(), 5)
    assert body.startswith(b"data: first\n\n")
    last = body.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    assert "error" in json.loads(last[len(b"data: ") :])


async def test_a_client_that_disconnects_closes_the_upstream_request(client: Any, echo: Any, caplog: Any) -> None:
    upstream, _ = echo
    resp = await client.post("/v1/wait_for_disconnect", json={})
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()
    await asyncio.wait_for(upstream.stream_closed.wait(), 5)
    # a client leaving is not an error of the proxy's: nothing at ERROR (no "Error handling request")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_an_oversized_body_is_413_with_a_json_reason(client: Any) -> None:
    resp = await client.post("/v1/completions", data=b"x" * 5000)
    assert resp.status == 413
    assert resp.headers["X-Lifeguard-Reason"] == "body_too_large"
    assert (await resp.json())["error"]["code"] == 413


async def test_an_unreachable_upstream_is_503_upstream_unreachable(serve_lifeguard: Any, unused_tcp_port: int) -> None:
    settings = Settings(upstream=f"http://127.0.0.1:{unused_tcp_port}", gpu_probe="none")
    proxy_client = await serve_lifeguard(settings)
    resp = await proxy_client.get("/v1/models")
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "upstream_unreachable"
    assert resp.headers["Retry-After"]
    body = await resp.json()
    assert body["error"]["code"] == 503


async def test_proxy_routes_answer_without_the_engine(serve_lifeguard: Any, unused_tcp_port: int) -> None:
    settings = Settings(upstream=f"http://127.0.0.1:{unused_tcp_port}", gpu_probe="none")
    proxy_client = await serve_lifeguard(settings)
    assert (await proxy_client.get("/lifeguard/healthz")).status == 200
    ready = await proxy_client.get("/lifeguard/readyz")
    assert ready.status == 503  # never seen the engine up: not ready yet
    state = await (await proxy_client.get("/lifeguard/state")).json()
    assert state["state"] == "STARTING"
    metrics = await proxy_client.get("/lifeguard/metrics")
    assert "lifeguard_state" in await metrics.text()


async def test_an_inference_request_to_an_engine_never_seen_up_is_held_not_forwarded(
    serve_lifeguard: Any, unused_tcp_port: int
) -> None:
    settings = Settings(upstream=f"http://127.0.0.1:{unused_tcp_port}", gpu_probe="none", hold_timeout_s=0.3)
    proxy_client = await serve_lifeguard(settings)
    resp = await proxy_client.post("/v1/completions", json={})
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "hold_timeout"  # a sidecar starts before vLLM: hold
