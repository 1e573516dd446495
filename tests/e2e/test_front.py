"""The front (proxy/front/connection.py) at the byte level: what it forwards, what it answers itself, and what it
refuses before anything reaches vLLM (request smuggling)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from proxy.app import Lifeguard
from proxy.config import Settings
from proxy.front.dispatcher import Front
from tests.e2e.conftest import Stack, lifeguard_of, raw_exchange, status_of
from tests.lifeguard_testing import listen_drops

COMPLETION = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
SMUGGLED = b"POST /sleep?level=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


async def _raw_stack(make_stack: Callable[..., Awaitable[Stack]], **overrides: Any) -> Stack:
    return await make_stack(**overrides)


def _front(stack: Stack) -> Front:
    front = stack.lifeguard.front
    assert front is not None
    return front


def _completion(*, close: bool = False) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Connection: close\r\n" if close else b""
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length, within a deadline."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split(" ")[1]), headers, body


def _error(raw: bytes) -> dict[str, Any]:
    """The error body of the first response in `raw`."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    length = next(int(line[15:]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    error: dict[str, Any] = json.loads(rest[:length])["error"]
    return error


async def test_admitted_inference_goes_to_vllm_on_one_pooled_connection(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack)
    for _ in range(3):
        assert (await stack.completion()).status == 200
    assert stack.engine.upstream.pool.open_connections == 1  # kept alive and reused
    assert stack.sim_count("generate") == 3
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_inference_requests_total{engine="default",outcome="forwarded"} 3.0' in metrics
    assert 'lifeguard_upstream_response_latency_seconds_count{engine="default"} 3.0' in metrics
    assert 'lifeguard_request_duration_seconds_count{engine="default",route_class="inference"} 3.0' in metrics


async def test_one_keep_alive_connection_mixes_inference_control_and_held_requests(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack)
    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(_completion())
        assert (await _read_response(reader))[0] == 200
        writer.write(b"GET /lifeguard/state HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["state"] == "RUNNING"
        writer.write(b"POST /sleep?level=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, headers, _ = await _read_response(reader)
        assert status == 200 and "x-lifeguard-verified" in headers
        writer.write(_completion())  # held by the application's gate, on this same connection
        await stack.wait_held(1)
        assert (await stack.client.post("/wake_up")).status == 200
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["choices"]
    finally:
        writer.close()
    assert stack.sim_count("generate") == 3  # the two completions and the wake's canary


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
        b"Content-Length: 5, 5\r\n\r\nhello",
        b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
        b"X-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        b"X-Nul: a\x00b\r\nContent-Length: 0\r\n\r\n",
        b"Content-Length : 0\r\n\r\n",
        b"Content-Length: 0\r\n\r\n",
    ],
    ids=[
        "cl-then-te",
        "te-then-cl",
        "same-length-twice",
        "length-list",
        "te-not-chunked-last",
        "bad-chunk-size",
        "chunk-size-overflow",
        "bad-second-chunk",
        "obs-fold",
        "nul-in-value",
        "space-before-colon",
        "no-host",
    ],
)
async def test_ambiguous_framing_is_400_json_and_nothing_reaches_vllm(
    make_stack: Callable[..., Awaitable[Stack]], framing: bytes
) -> None:
    stack = await _raw_stack(make_stack)
    before = dict(stack.sim.counters)
    host = b"" if framing == b"Content-Length: 0\r\n\r\n" else b"Host: x\r\n"
    raw = await raw_exchange(stack, b"POST /v1/completions HTTP/1.1\r\n" + host + framing + SMUGGLED)
    assert status_of(raw) == 400, raw[:300]
    assert b"\r\nConnection: close\r\n" in raw
    error = _error(raw)
    assert error["reason"] == "bad_request" and error["code"] == 400 and error["src"] == "lifeguard"
    assert dict(stack.sim.counters) == before, "a request reached vLLM"
    assert (await stack.state())["state"] == "RUNNING"


@pytest.mark.parametrize(
    ("head", "status", "reason"),
    [
        (b"GET /v1/models?q=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "target_too_long"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, "headers_too_large"),
        (MODELS + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n", 431, "headers_too_large"),
        (MODELS + b"".join(b"X-H%d: %b\r\n" % (i, b"v" * 700) for i in range(100)) + b"\r\n", 431,
         "headers_too_large"),
    ],
    ids=["long-target", "long-header-line", "many-headers", "large-head"],
)  # fmt: skip
async def test_an_oversized_request_head_is_refused_and_the_proxy_lives_on(
    make_stack: Callable[..., Awaitable[Stack]], head: bytes, status: int, reason: str
) -> None:
    stack = await _raw_stack(make_stack)
    raw = await raw_exchange(stack, head)
    assert status_of(raw) == status, raw[:300]
    assert _error(raw)["reason"] == reason
    assert (await stack.completion()).status == 200


async def test_a_chunked_inference_body_is_forwarded_whole_and_one_over_the_limit_is_413(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack, max_body_bytes=200)
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (COMPLETION[:10], COMPLETION[10:])) + b"0\r\n\r\n"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    raw = await raw_exchange(stack, head + chunks)
    assert status_of(raw) == 200, raw[:300]
    big = b"%x\r\n%b\r\n0\r\n\r\n" % (300, b"x" * 300)
    raw = await raw_exchange(stack, head + big)
    assert status_of(raw) == 413 and _error(raw)["reason"] == "body_too_large", raw[:300]
    assert stack.sim_count("generate") == 1
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_request_duration_seconds_count{engine="default",route_class="inference"} 2.0' in metrics


async def test_a_bad_target_is_the_same_400_as_the_aiohttp_path_and_the_connection_is_kept(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack)
    raw = await raw_exchange(
        stack, b"POST /v1/../sleep HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" + _completion(close=True)
    )
    assert status_of(raw) == 400 and _error(raw)["reason"] == "bad_request_target"
    assert raw.count(b"HTTP/1.1 200 OK") == 1  # the next request on the connection was answered
    assert not stack.sim.is_sleeping


class Firehose:
    """A vLLM stand-in whose one stream sends far more than any socket buffer holds, as fast as it may."""

    TOTAL = 16 * 1024 * 1024

    def __init__(self) -> None:
        self.app = web.Application()
        for path, flag in (("/health", None), ("/is_sleeping", "is_sleeping"), ("/is_paused", "is_paused")):
            self.app.router.add_get(path, self._flag(flag))
        self.app.router.add_post("/v1/firehose", self._firehose)

    @staticmethod
    def _flag(name: str | None) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response({name: False}) if name else web.Response()

        return handler

    async def _firehose(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
        for _ in range(self.TOTAL // len(event)):
            await resp.write(event)
        await resp.write_eof()
        return resp


async def test_a_client_that_stops_reading_stops_the_front_reading_vllm_and_loses_nothing(
    aiohttp_server: Any, serve_lifeguard: Any
) -> None:
    firehose = Firehose()
    upstream = await aiohttp_server(firehose.app)
    settings = Settings(
        upstream=str(upstream.make_url("")).rstrip("/"), gpu_probe="none", routes={"inference": ["/v1/firehose"]}
    )
    client = await serve_lifeguard(settings)
    server = client.server
    front = lifeguard_of(client).front
    assert front is not None
    deadline = time.monotonic() + 10
    while (await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection(server.host, server.port, limit=1024)
    try:
        writer.write(b"POST /v1/firehose HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        # Nothing is read: the proxy's send buffer to this client fills, and it must stop reading vLLM.
        while not any(conn.writing_paused for conn in front.connections):
            assert time.monotonic() < deadline, "the client's transport never went over its high-water mark"
            await asyncio.sleep(0.01)
        paused = [conn for conn in front.connections if conn.writing_paused]
        exchange = paused[0]._active
        assert exchange is not None and exchange.conn is not None and exchange.conn.transport is not None
        assert not exchange.conn.transport.is_reading()
        received = 0
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    break
                received += len(await reader.readexactly(size + 2)) - 2
        assert received == Firehose.TOTAL // (64 * 1024) * 64 * 1024
    finally:
        writer.close()


async def test_a_pipelined_request_whose_body_comes_later_is_read_once_the_one_before_is_answered(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack)
    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    tokenize = b'{"model": "tiny", "prompt": "hello"}'
    try:
        head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        writer.write(_completion() + head % len(tokenize))
        assert (await _read_response(reader))[0] == 200
        writer.write(tokenize)  # reading was paused behind the completion; the answer must resume it
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["tokens"], body
    finally:
        writer.close()


async def test_the_vllm_pool_opens_no_more_than_its_limit_and_queues_the_rest(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack, upstream_max_connections=2)
    answers = await asyncio.gather(*(stack.completion(prompt=f"p{n}") for n in range(8)))
    assert [answer.status for answer in answers] == [200] * 8
    assert stack.engine.upstream.pool.open_connections <= 2
    assert stack.sim_count("generate") == 8


async def test_the_vllm_pool_opens_no_more_than_upstream_max_connecting_at_once_and_queues_the_rest(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack, upstream_max_connecting=2)
    pool = stack.engine.upstream.pool
    connect = pool._connect
    at_once: list[int] = []

    async def counted(factory: Any) -> Any:
        at_once.append(pool.connecting)
        return await connect(factory)

    pool._connect = counted
    answers = await asyncio.gather(*(stack.completion(prompt=f"p{n}") for n in range(8)))
    assert [answer.status for answer in answers] == [200] * 8
    assert at_once and max(at_once) <= 2, at_once
    assert stack.sim_count("generate") == 8


async def test_at_the_defaults_a_burst_opens_as_many_connections_at_once_as_the_kernel_lets_vllm_queue(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """A batch of new streams waits on its connects to vLLM (docs/performance.md, 2026-12-07): at the defaults as
    many are opened at once as the kernel's cap on vLLM's listen queue allows, up to 1,024 (128 before)."""
    stack = await _raw_stack(make_stack)
    pool = stack.engine.upstream.pool
    opened: list[object] = []
    failed: list[str] = []

    class Waiter:
        wants_connection = True

        def connected(self, conn: Any) -> None:
            opened.append(conn)
            conn.reusable = True
            conn.release()

        def connect_failed(self, why: str) -> None:
            failed.append(why)

        def crashed(self, where: str, exc: BaseException) -> None:
            failed.append(f"{where}: {exc!r}")

    burst = 300
    for _ in range(burst):
        pool.acquire(Waiter())
    with open("/proc/sys/net/core/somaxconn") as f:  # the kernel's, as the proxy reads it
        expected = min(1024, int(f.read()))
    assert pool.connecting == min(burst, expected) > 128
    deadline = time.monotonic() + 20
    while len(opened) + len(failed) < burst:
        assert time.monotonic() < deadline, f"{len(opened)} of {burst} waiters got a connection within 20 s"
        await asyncio.sleep(0.01)
    assert not failed, failed[:3]


class Streams:
    """A vLLM stand-in whose streams send one event, then hold their connection until `ended` is set."""

    def __init__(self) -> None:
        self.app = web.Application()
        for path, flag in (("/health", None), ("/is_sleeping", "is_sleeping"), ("/is_paused", "is_paused")):
            self.app.router.add_get(path, Firehose._flag(flag))
        self.app.router.add_post("/v1/completions", self._stream)
        self.ended = asyncio.Event()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": " x"}]}\n\n')
        await self.ended.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_more_streams_at_once_than_the_old_cap_of_1024_connections_all_deliver_at_the_defaults(
    aiohttp_server: Any, serve_lifeguard: Any
) -> None:
    """An RL batch of streams fired at once: each holds its vLLM connection for its whole generation, so a cap on
    open connections below the batch would starve the streams past it until others end (here: never)."""
    streams = Streams()
    upstream = await aiohttp_server(streams.app)
    client = await serve_lifeguard(Settings(upstream=str(upstream.make_url("")).rstrip("/"), gpu_probe="none"))
    server = client.server
    deadline = time.monotonic() + 10
    while (await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    count = 1100
    body = b'{"model": "tiny", "prompt": "hi", "stream": true}'
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    connects = asyncio.Semaphore(100)  # the test's own connects in waves: the proxy's listen backlog is not tested
    writers: list[asyncio.StreamWriter] = []

    async def first_event() -> bytes:
        async with connects:
            reader, writer = await asyncio.open_connection(server.host, server.port)
        writers.append(writer)
        writer.write(request)
        await reader.readuntil(b"\r\n\r\n")
        return await reader.readuntil(b"\n\n")

    try:
        async with asyncio.timeout(60):
            events = await asyncio.gather(*(first_event() for _ in range(count)))
        assert all(event.endswith(b'{"choices": [{"text": " x"}]}\n\n') for event in events)
        assert lifeguard_of(client).engines["default"].upstream.pool.open_connections == count
    finally:
        streams.ended.set()
        for writer in writers:
            writer.close()


async def test_an_idle_pooled_connection_past_upstream_keepalive_s_is_closed_not_reused(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack, upstream_keepalive_s=0.2)
    pool = stack.engine.upstream.pool
    assert (await stack.completion()).status == 200
    deadline = time.monotonic() + 5
    while pool.open_connections:
        assert time.monotonic() < deadline, "the idle connection was never closed"
        await asyncio.sleep(0.02)
    assert (await stack.completion()).status == 200


async def test_vllm_gone_under_an_admitted_request_is_503_upstream_unreachable_in_the_one_error_format(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack, reconcile_interval_s=60.0)  # the gate still says RUNNING
    await stack.sim_server.close()
    resp = await stack.completion()
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "upstream_unreachable" and resp.headers["Retry-After"]
    error = (await resp.json())["error"]
    assert error["reason"] == "upstream_unreachable" and error["src"] == "lifeguard"
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_inference_requests_total{engine="default",outcome="upstream_unreachable"} 1.0' in metrics


async def test_a_connection_that_answered_a_5xx_is_not_reused(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    """uvicorn closes the connection after an unhandled exception's 500 without `Connection: close`."""
    peers: list[Any] = []

    async def boom(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"error": "boom"}, status=500)

    upstream_app = Firehose().app
    upstream_app.router.add_post("/v1/completions", boom)
    upstream = await aiohttp_server(upstream_app)
    client = await serve_lifeguard(Settings(upstream=str(upstream.make_url("")).rstrip("/"), gpu_probe="none"))
    deadline = time.monotonic() + 10
    while (await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    for _ in range(2):
        resp = await client.post("/v1/completions", json={})
        assert resp.status == 500 and (await resp.json()) == {"error": "boom"}  # vLLM's answer, relayed
    assert len(peers) == 2 and peers[0] != peers[1]


async def test_a_held_request_waits_parked_in_the_front_and_goes_straight_to_vllm_on_the_wake(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _raw_stack(make_stack)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    front = _front(stack)
    assert [type(conn._active).__name__ for conn in front.connections if conn._active is not None] == ["HeldExchange"]
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await held).status == 200
    assert stack.engine.upstream.pool.open_connections == 1  # forwarded on the pool
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert 'lifeguard_inference_requests_total{engine="default",outcome="forwarded"} 1.0' in metrics
    assert 'lifeguard_hold_duration_seconds_count{engine="default",outcome="forwarded"} 1.0' in metrics


async def test_a_smuggling_attempt_pipelined_behind_a_held_request_meets_a_parser_as_strict_as_the_first(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """A held request's connection lets llhttp's parser go and makes a new one when bytes arrive (issue 21,
    memory per held client): the request after it, CL+TE framing with a /sleep behind, is refused as on a
    fresh connection, and the /sleep never reaches vLLM."""
    stack = await _raw_stack(make_stack)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    sleeps = stack.sim_count("sleep")
    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(_completion())
        await stack.wait_held(1)
        held = [conn for conn in _front(stack).connections if conn._active is not None]
        assert [conn._reader._parser for conn in held] == [None]  # the parser was let go while it waits
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\n" + SMUGGLED
        )
        await writer.drain()
        assert (await stack.client.post("/wake_up")).status == 200
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["choices"]
        async with asyncio.timeout(10):
            refusal = await reader.read()  # then the connection ends
    finally:
        writer.close()
    assert status_of(refusal) == 400 and b"\r\nConnection: close\r\n" in refusal, refusal[:300]
    assert _error(refusal)["reason"] == "bad_request"
    assert stack.sim_count("sleep") == sleeps, "the smuggled /sleep reached vLLM"
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_burst_of_connections_larger_than_the_listen_backlog_is_all_answered(aiohttp_server: Any) -> None:
    """64 clients connect in one turn of the loop to a proxy listening with a backlog of 8: the kernel's queue
    overflows (it says so) and the clients retry their connect; every one is answered, nothing is cut."""
    upstream = await aiohttp_server(Firehose().app)
    lifeguard = Lifeguard(Settings(upstream=str(upstream.make_url("")).rstrip("/"), gpu_probe="none"))
    await lifeguard.start("127.0.0.1", 0, backlog=8)
    writers: list[asyncio.StreamWriter] = []
    turned_away = listen_drops(lifeguard.port)
    try:
        async with asyncio.timeout(30):  # a connect turned away is sent again after 1 s, then 2 s, ...
            # All 64 connects start in this turn, before the proxy's listener can accept any.
            streams = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", lifeguard.port) for _ in range(64)))
        assert listen_drops(lifeguard.port) > turned_away, "the accept queue never overflowed: the test did not test it"
        writers = [writer for _, writer in streams]
        for writer in writers:  # no await in between: the proxy reads all 64 in its next turn
            writer.write(b"GET /lifeguard/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = await asyncio.gather(*(_read_response(reader) for reader, _ in streams), return_exceptions=True)
        assert [a if isinstance(a, BaseException) else a[0] for a in answers] == [200] * 64
    finally:
        for writer in writers:
            writer.close()
        await lifeguard.close()
