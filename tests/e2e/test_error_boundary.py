"""The one error boundary (proxy/front/boundary.py): a bug in any callback of the data plane is answered, logged
once with its traceback, counted in `lifeguard_proxy_errors_total`, and the proxy serves on.

Each test makes one callback raise once (a stand-in for a bug of ours) and asserts what a client sees: 503
`proxy_error` in vLLM's error shape when nothing was answered yet, the SSE error event and the stream's end
when a stream had begun; then the next request is answered as usual."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from proxy.compiled import build
from proxy.config import Settings
from proxy.front import exchange, held
from proxy.front.dispatcher import Front
from proxy.front.own_answers import _OWN
from tests.e2e.conftest import Stack, raw_exchange, status_of

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
#: A bug planted by monkeypatching a method that compiled callers call directly (or on a native instance, which takes
#: no attribute) is not planted in the compiled build: such a test runs in the pure one (`make test`'s second run).
PATCHES_COMPILED = pytest.mark.skipif(
    build() == "compiled", reason="plants its bug in a method the compiled build calls directly: runs on the pure build"
)


class Bug(Exception):
    """What a bug of ours raises."""


class Bugs:
    """Plants a bug of ours in one callback and checks how the proxy got over it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
        self.monkeypatch = monkeypatch
        self._caplog = caplog
        caplog.set_level(logging.ERROR, logger="lifeguard.bug")

    def raise_once(self, cls: Any, name: str, *, after: int = 0) -> None:
        """`cls.name` raises Bug on its call number `after` + 1, and only then."""
        original = getattr(cls, name)
        seen: list[int] = []

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(1)
            if len(seen) == after + 1:
                raise Bug(f"a bug in {cls.__name__}.{name}")
            return original(self, *args, **kwargs)

        self.monkeypatch.setattr(cls, name, wrapper)

    def logged(self) -> list[logging.LogRecord]:
        return [record for record in self._caplog.records if record.name == "lifeguard.bug"]

    def assert_logged_once(self) -> None:
        """The bug was logged once, with its traceback."""
        records = self.logged()
        assert len(records) == 1 and records[0].exc_info is not None and records[0].exc_info[0] is Bug, records

    async def serves_on(self, stack: Stack, where: str) -> None:
        """The next request is answered; the bug was logged once, with its traceback, and counted."""
        resp = await stack.completion()
        assert resp.status == 200, await resp.text()
        self.assert_logged_once()
        metrics = await (await stack.client.get("/lifeguard/metrics")).text()
        assert f'lifeguard_proxy_errors_total{{where="{where}"}} 1.0' in metrics


@pytest.fixture
def bugs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Bugs:
    return Bugs(monkeypatch, caplog)


@pytest.fixture
async def stack(make_stack: Callable[..., Awaitable[Stack]]) -> Stack:
    return await make_stack()


def front_of(stack: Stack) -> Front:
    front = stack.lifeguard.front
    assert front is not None
    return front


async def _answered_503_proxy_error(resp: Any) -> None:
    assert resp.status == 503, await resp.text()
    assert resp.headers["X-Lifeguard-Reason"] == "proxy_error"
    error = (await resp.json())["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and error["src"] == "lifeguard"


@pytest.mark.parametrize(
    ("cls", "name", "where"),
    [
        (exchange.Forward, "connected", "forward"),  # the pool hands it a connection
        (exchange.Forward, "response_head", "upstream"),  # llhttp read vLLM's head
        (exchange.Forward, "response_body", "upstream"),  # ... its body
        (exchange.Forward, "response_end", "upstream"),  # ... its end
        pytest.param(Front, "exchange_for", "client", marks=PATCHES_COMPILED),  # deciding, in data_received
        (exchange.Forward, "start", "client"),
    ],
)
async def test_a_bug_on_the_way_to_vllm_or_back_is_503_proxy_error_and_the_proxy_serves_on(
    stack: Stack, bugs: Bugs, cls: Any, name: str, where: str
) -> None:
    bugs.raise_once(cls, name)
    await _answered_503_proxy_error(await stack.completion())
    await bugs.serves_on(stack, where)
    assert (await stack.state())["inflight_requests"] == 0  # the ticket was given back


@pytest.mark.parametrize(
    ("name", "after"),
    [
        ("response_body", 2),  # an event of the stream
        ("end_read", 0),  # the write of what vLLM's first read brought
    ],
)
async def test_a_bug_mid_stream_ends_the_stream_with_the_error_event(
    stack: Stack, bugs: Bugs, name: str, after: int
) -> None:
    bugs.raise_once(exchange.Forward, name, after=after)
    resp = await stack.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 8, "stream": True})
    assert resp.status == 200  # sent before the bug
    events = [line for line in (await resp.text()).split("\n\n") if line.startswith("data: ")]
    last = json.loads(events[-1][len("data: ") :])
    assert last["error"]["reason"] == "proxy_error" and last["error"]["src"] == "lifeguard", events
    await bugs.serves_on(stack, "upstream")


@PATCHES_COMPILED
async def test_a_bug_reading_a_request_head_is_503_and_the_connection_closes(stack: Stack, bugs: Bugs) -> None:
    front = front_of(stack)
    route = front.router.route
    calls: list[bytes] = []

    def buggy(method: bytes, url: bytes) -> Any:  # called from inside llhttp's callback
        calls.append(url)
        if len(calls) == 1:
            raise Bug("a bug in the router")
        return route(method, url)

    bugs.monkeypatch.setattr(front.router, "route", buggy)
    raw = await raw_exchange(stack, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(raw) == 503 and b"proxy_error" in raw and b"\r\nConnection: close\r\n" in raw, raw[:300]
    await bugs.serves_on(stack, "client")


@PATCHES_COMPILED
async def test_a_bug_releasing_a_held_request_answers_it_and_the_rest_are_released(stack: Stack, bugs: Bugs) -> None:
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    waiting = [asyncio.ensure_future(stack.completion(prompt=f"p{n}")) for n in range(3)]
    await stack.wait_held(3)
    bugs.raise_once(exchange.Forward, "__init__")  # the first one admitted cannot be forwarded
    assert (await stack.client.post("/wake_up")).status == 200
    answers = await asyncio.gather(*waiting)
    assert sorted(resp.status for resp in answers) == [200, 200, 503]
    await _answered_503_proxy_error(next(resp for resp in answers if resp.status == 503))
    await bugs.serves_on(stack, "hold")
    assert (await stack.state())["inflight_requests"] == 0


@PATCHES_COMPILED
async def test_a_bug_answering_a_held_request_drops_its_connection_and_the_proxy_serves_on(
    make_stack: Callable[..., Awaitable[Stack]], bugs: Bugs
) -> None:
    stack = await make_stack(hold_timeout_s=0.3)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    bugs.raise_once(held.HeldExchange, "_end")
    raw = await raw_exchange(stack, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert raw == b""  # nothing could be answered: the connection is dropped, never left hanging
    assert (await stack.client.post("/wake_up")).status == 200
    await bugs.serves_on(stack, "hold")


async def test_a_bug_in_an_answer_of_the_proxys_own_is_503(stack: Stack, bugs: Bugs) -> None:
    async def state(*_: Any) -> Any:
        raise Bug("a bug in /lifeguard/state")

    bugs.monkeypatch.setitem(_OWN, "/lifeguard/state", state)
    await _answered_503_proxy_error(await stack.client.get("/lifeguard/state"))
    bugs.monkeypatch.undo()
    await bugs.serves_on(stack, "answer")


async def test_a_bug_when_the_client_pauses_reading_ends_its_exchange_and_the_proxy_serves_on(
    stack: Stack, bugs: Bugs
) -> None:
    front = front_of(stack)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    bugs.raise_once(held.HeldExchange, "client_writable")
    reader, writer = await asyncio.open_connection(stack.client.server.host, stack.client.server.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await stack.wait_held(1)
        (conn,) = [conn for conn in front.connections if conn._active is not None]
        conn.pause_writing()  # as asyncio calls it when the client's send buffer is full
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    assert status_of(answer) == 503 and b"proxy_error" in answer and b"\r\nConnection: close\r\n" in answer
    assert (await stack.state())["held_requests"] == 0
    assert (await stack.client.post("/wake_up")).status == 200
    await bugs.serves_on(stack, "client")


async def test_a_bug_hearing_that_vllm_closed_the_connection_is_answered(
    aiohttp_server: Any, serve_lifeguard: Any, bugs: Bugs
) -> None:
    app = web.Application()
    for path, flag in (("/health", None), ("/is_sleeping", "is_sleeping"), ("/is_paused", "is_paused")):
        app.router.add_get(path, _flag(flag))

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b"half")
        assert request.transport is not None
        request.transport.close()  # vLLM gone mid-answer
        return resp

    app.router.add_post("/v1/cut", cut)
    upstream = await aiohttp_server(app)
    settings = Settings(
        upstream=str(upstream.make_url("")).rstrip("/"), gpu_probe="none", routes={"inference": ["/v1/cut"]}
    )
    client = await serve_lifeguard(settings)
    async with asyncio.timeout(10):
        while (await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
            await asyncio.sleep(0.01)
    bugs.raise_once(exchange.Forward, "upstream_lost")
    await _answered_503_proxy_error(await client.post("/v1/cut", data=b"{}"))
    bugs.assert_logged_once()
    resp = await client.post("/v1/cut", data=b"{}")  # no bug this time: vLLM's loss, as always
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "upstream_unreachable"


def _flag(name: str | None) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({name: False}) if name else web.Response()

    return handler
