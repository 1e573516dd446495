"""benchmarks/floor.py, the bare relay `outside.py --vary floor` measures beside lifeguard: every answer reaches
its client whole and in order, over keep-alive connections, with answers that arrive in pieces and requests that
come pipelined, in front of aiohttp's server (none of the relay's code on the other side)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from benchmarks import floor


async def _echo(request: web.Request) -> web.StreamResponse:
    """The request's body back, written in two pieces with a pause between (an answer the relay reads in parts)."""
    body = await request.read()
    answer = web.StreamResponse(headers={"Content-Length": str(2 * len(body))})
    await answer.prepare(request)
    await answer.write(body)
    await asyncio.sleep(0.01)
    await answer.write(body)
    await answer.write_eof()
    return answer


async def test_answers_reach_their_clients_whole_and_in_order(aiohttp_server: Any) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _echo)
    upstream = await aiohttp_server(app)
    loop = asyncio.get_running_loop()
    relay = floor.Relay(upstream.port)
    server = await loop.create_server(lambda: floor.ClientSide(relay), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            bodies = [b"a" * 10, b"bb" * 3000, b"c"]
            # pipelined: all three sent before any answer is read
            writer.write(b"".join(_request(body) for body in bodies))
            for body in bodies:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                assert floor.body_length(head[:-4]) == 2 * len(body)
                assert await reader.readexactly(2 * len(body)) == body + body
            writer.close()
    finally:
        server.close()
        for upstream_side in relay.idle:
            upstream_side.transport.close()


def _request(body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
