"""The floor under issue 39's CPU target: the least Python an HTTP/1.1 reverse proxy on uvloop runs per request.

A relay and nothing else: a client's request found by its head's end and Content-Length and written as it came
to a pooled keep-alive connection to the upstream; the answer relayed as it comes, its end found the same way.
No routing, no header rewriting, no state, no metrics, no logging, no chunked bodies (wrk's requests and the
rig's nginx upstream have none). What lifeguard costs above this is its own; what this costs above nginx, any
proxy written in Python on uvloop pays. `outside.py --vary floor` runs it beside lifeguard and nginx.
Usage: .venv/bin/python -m benchmarks.floor --port PORT --upstream-port PORT
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import uvloop

HEAD_END = b"\r\n\r\n"


def body_length(head: bytes) -> int:
    """Content-Length from a head (lower-cased search: nginx and wrk spell it differently); 0 without one."""
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    start = at + len(b"\r\ncontent-length:")
    stop = head.find(b"\r\n", start)
    return int(head[start : stop if stop >= 0 else len(head)])


class UpstreamSide(asyncio.Protocol):
    """One pooled connection to the upstream: relays one answer at a time back to its client."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.client: ClientSide | None = None
        self.head = bytearray()
        self.left = -1  # bytes of the answer still to come; -1 while its head is being read
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        client = self.client
        assert client is not None
        client.transport.write(data)
        if self.left < 0:
            self.head += data
            end = self.head.find(HEAD_END)
            if end < 0:
                return
            self.left = end + 4 + body_length(bytes(self.head[:end])) - len(self.head)
            self.head.clear()
        else:
            self.left -= len(data)
        if self.left <= 0:
            self.left, self.client = -1, None
            self.relay.idle.append(self)
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        if self.client is not None:
            self.client.transport.close()


class ClientSide(asyncio.Protocol):
    """One client connection: its requests relayed one at a time, in order."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.buffer = bytearray()
        self.waiting = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.next_request()

    def next_request(self) -> None:
        if self.waiting:
            return
        end = self.buffer.find(HEAD_END)
        if end < 0:
            return
        size = end + 4 + body_length(bytes(self.buffer[:end]))
        if len(self.buffer) < size:
            return
        request = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.waiting = True
        if self.relay.idle:
            self.relay.send(self.relay.idle.pop(), self, request)
        else:
            self.relay.connect_then_send(self, request)

    def answered(self) -> None:
        self.waiting = False
        if self.buffer:
            self.next_request()


class Relay:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.idle: list[UpstreamSide] = []
        self.connecting: set[asyncio.Task[None]] = set()

    def send(self, upstream: UpstreamSide, client: ClientSide, request: bytes) -> None:
        upstream.client = client
        upstream.transport.write(request)

    def connect_then_send(self, client: ClientSide, request: bytes) -> None:
        async def connect() -> None:
            loop = asyncio.get_running_loop()
            _, upstream = await loop.create_connection(lambda: UpstreamSide(self), "127.0.0.1", self.upstream_port)
            self.send(upstream, client, request)

        task = asyncio.get_running_loop().create_task(connect())
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)


async def serve(port: int, upstream_port: int) -> None:
    relay = Relay(upstream_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientSide(relay), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream_port))


if __name__ == "__main__":
    main()
