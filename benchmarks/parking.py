"""Would a held client parked without its transport meet ≤ 2 KB? A server of bare uvloop transports, measured
against the same server parking each connection as a bare descriptor in one epoll set (at accept, and again once
its request is in: the descriptor duplicated, the transport aborted), a transport made again to answer.

N clients connect, then each sends one request at once (as `hold.py` does); the server's RSS per connection and
per held client, then the time from the release to the last client's answer. Each server is a fresh process (a
forked one would reuse the heap its parent freed, and no RSS would grow). Linux only (epoll).
Usage: .venv/bin/python -m benchmarks.parking [--clients 8000] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import uvloop

WATCH = select.EPOLLIN | select.EPOLLRDHUP


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Held(asyncio.Protocol):
    """One server connection: its request is held until the release."""

    __slots__ = ("server", "transport", "stale", "then", "fd")

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: Any = None
        self.stale = 0  # connection_lost calls still due from aborted transports
        self.then: Any = None
        self.fd: int | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def data_received(self, data: bytes) -> None:
        self.server.held.append(self)
        if self.server.park:
            self.fd = os.dup(self.transport.get_extra_info("socket").fileno())
            self.stale += 1
            transport, self.transport = self.transport, None
            transport.abort()
            self.server.watch(self.fd, self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stale:
            self.stale -= 1


class Server:
    def __init__(self, park: bool) -> None:
        self.park = park
        self.held: list[Held] = []
        self.epoll = select.epoll()
        self.waiting: dict[int, Held | None] = {}
        self.tasks: set[asyncio.Task[Any]] = set()

    def watch(self, fd: int, conn: Held | None) -> None:
        self.waiting[fd] = conn
        self.epoll.register(fd, WATCH)

    def attach(self, fd: int, conn: Held) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: conn, socket.socket(fileno=fd)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def ready(self) -> None:
        for fd, _ in self.epoll.poll(0):
            conn = self.waiting.pop(fd)
            self.epoll.unregister(fd)
            if conn is None:  # a fresh connection's first bytes
                self.attach(fd, Held(self))

    def accept(self, listening: socket.socket) -> None:
        while True:
            try:
                sock, _ = listening.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            fd = sock.detach()
            if self.park:
                self.watch(fd, None)
            else:
                self.attach(fd, Held(self))

    def release(self) -> None:
        for conn in self.held:
            if conn.transport is not None:
                conn.transport.write(b"ok")
            elif conn.fd is not None:
                fd, conn.fd = conn.fd, None
                self.waiting.pop(fd)
                self.epoll.unregister(fd)
                conn.then = lambda conn=conn: conn.transport.write(b"ok")
                self.attach(fd, conn)


def serve(park: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = Server(park)
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        listening.listen(4096)
        listening.setblocking(False)
        loop.add_reader(server.epoll.fileno(), server.ready)
        loop.add_reader(listening.fileno(), server.accept, listening)
        loop.add_signal_handler(signal.SIGUSR1, server.release)
        print(listening.getsockname()[1], flush=True)
        await asyncio.sleep(3600)

    uvloop.run(main())


class Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.answered: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.answered.done():
            self.answered.set_result(time.perf_counter())

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answered.done():
            self.answered.set_exception(RuntimeError("the server closed a held connection"))


async def clients(pid: int, port: int, count: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0.3)
    rss0 = rss(pid)
    opened: list[Client] = []
    for start in range(0, count, 250):
        batch = [loop.create_connection(Client, "127.0.0.1", port) for _ in range(min(250, count - start))]
        opened += [proto for _, proto in await asyncio.gather(*batch)]
    await asyncio.sleep(0.5)
    rss1 = rss(pid)
    for client in opened:
        client.transport.write(b"GET / HTTP/1.1\r\n\r\n")
    await asyncio.sleep(1.5)
    rss2 = rss(pid)
    released = time.perf_counter()
    os.kill(pid, signal.SIGUSR1)
    async with asyncio.timeout(60):
        answered = await asyncio.gather(*(client.answered for client in opened))
    for client in opened:
        client.transport.close()
    return {
        "per_conn": (rss1 - rss0) / count,
        "per_held": (rss2 - rss0) / count,
        "release_ms": (max(answered) - released) * 1e3,
    }


def run(park: bool, count: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--serve", "parked" if park else "transports"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        return uvloop.run(clients(server.pid, port, count))
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--serve", choices=("transports", "parked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.serve:
        serve(args.serve == "parked")
        return
    for rep in range(args.reps):
        for park in (False, True):
            r = run(park, args.clients)
            print(f"rep {rep + 1} {'parked' if park else 'transports'}: {r['per_conn']:.0f} B per open connection, "
                  f"{r['per_held']:.0f} B per held client, all {args.clients} answered {r['release_ms']:.0f} ms "
                  "after the release", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
