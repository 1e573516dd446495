"""The listening socket: connections accepted in batches, each handed to the loop as a transport of the front.

Not `loop.create_server`: on uvloop a listening socket accepts one connection per loop iteration, and a busy
iteration takes tens of milliseconds (docs/performance.md, 2026-12-03). Here every readiness accepts what is queued,
up to `ACCEPT_BATCH`; out of descriptors, accepting pauses as asyncio's own server does.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

from ..tasks import Tasks

log = logging.getLogger("lifeguard.listener")

ACCEPT_BATCH = 512
_EMFILE_PAUSE_S = 1.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Listener:
    """Accepts on `sock` (bound, listening) while open; `close()` stops accepting and closes it."""

    def __init__(self, sock: socket.socket, protocol: Callable[[], asyncio.Protocol]) -> None:
        self.sock = sock
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()
        self._handovers = Tasks()
        self._paused: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    log.error("cannot accept a connection (%s); accepting again in %g s", exc, _EMFILE_PAUSE_S,
                              extra={"event": "accept_paused"})  # fmt: skip
                    self._loop.remove_reader(self.sock.fileno())
                    self._paused = self._loop.call_later(_EMFILE_PAUSE_S, self._resume)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):  # the client left before it was accepted
                    continue
                raise
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's own server sets it
            self._handovers.spawn(self._hand_over(conn), name="accept")

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn)
        except OSError as exc:
            conn.close()
            log.warning("an accepted connection could not be served: %s", exc, extra={"event": "accept_failed"})

    def _resume(self) -> None:
        self._paused = None
        if self.sock.fileno() >= 0:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    async def close(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        elif self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        await self._handovers.close()


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address `host` names (as `loop.create_server` binds them): SO_REUSEADDR, and an
    IPv6 socket that does not also take IPv4."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks
