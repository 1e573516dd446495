"""The listening socket accepts a burst of clients at once, on uvloop (the proxy's loop) and on asyncio's, while every
loop iteration is slow (as when hundreds of streams are relayed): libuv's own listener takes one connection per
iteration, and a burst of 512 streams waited seconds to be accepted (docs/performance.md)."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Callable

import pytest
import uvloop

from proxy.listener import Listener, listening_sockets

CLIENTS = 200
BUSY_ITERATION_S = 0.02  # the load: every loop iteration spends this long, as a relaying proxy's do under load
DEADLINE_S = 2.0  # one accept per iteration would need CLIENTS x BUSY_ITERATION_S = 4 s


class _Counted(asyncio.Protocol):
    def __init__(self, made: list[float], all_made: asyncio.Future[None]) -> None:
        self._made = made
        self._all_made = all_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(time.monotonic())
        if len(self._made) == CLIENTS:
            self._all_made.set_result(None)


async def _burst(listen: Callable[[socket.socket, Callable[[], asyncio.Protocol]], object]) -> float:
    """Seconds from the burst's last connect until the last of its connections is accepted; raises past the deadline."""
    loop = asyncio.get_running_loop()
    made: list[float] = []
    all_made: asyncio.Future[None] = loop.create_future()
    (sock,) = listening_sockets("127.0.0.1", 0)
    sock.listen(1024)
    port = sock.getsockname()[1]
    listener = listen(sock, lambda: _Counted(made, all_made))
    running = True

    def busy() -> None:
        time.sleep(BUSY_ITERATION_S)
        if running:
            loop.call_soon(busy)

    clients: list[socket.socket] = []

    def connect_all() -> None:
        for _ in range(CLIENTS):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))

    loop.call_soon(busy)
    try:
        connector = threading.Thread(target=connect_all)
        connector.start()
        await asyncio.to_thread(connector.join, 10)
        connected = time.monotonic()
        try:
            async with asyncio.timeout(DEADLINE_S):
                await all_made
        except TimeoutError:
            pytest.fail(f"{len(made)} of {CLIENTS} connections accepted within {DEADLINE_S} s")
        return max(made) - connected
    finally:
        running = False
        for client in clients:
            client.close()
        if isinstance(listener, Listener):
            await listener.close()
        else:
            sock.close()


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"])
@pytest.mark.timeout(30)
def test_a_burst_of_clients_is_accepted_at_once_while_the_loop_is_busy(loop_factory):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        waited = runner.run(_burst(Listener))
    assert waited < DEADLINE_S


@pytest.mark.timeout(30)
def test_the_port_is_free_again_once_the_listener_is_closed():
    async def run() -> None:
        (sock,) = listening_sockets("127.0.0.1", 0)
        sock.listen(8)
        port = sock.getsockname()[1]
        await Listener(sock, asyncio.Protocol).close()
        (again,) = listening_sockets("127.0.0.1", port)
        again.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


class _RunsOutOfDescriptorsOnce:
    """A listening socket whose first accept fails as a process out of descriptors does (EMFILE)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.failed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def close(self) -> None:
        self._sock.close()

    def accept(self) -> tuple[socket.socket, object]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"])
@pytest.mark.timeout(30)
def test_out_of_descriptors_pauses_accepting_and_the_waiting_client_is_served_after(loop_factory, caplog):
    async def run() -> None:
        loop = asyncio.get_running_loop()
        (sock,) = listening_sockets("127.0.0.1", 0)
        sock.listen(8)
        port = sock.getsockname()[1]
        wrapped = _RunsOutOfDescriptorsOnce(sock)
        made: asyncio.Future[None] = loop.create_future()

        class Served(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                if not made.done():
                    made.set_result(None)

        listener = Listener(wrapped, Served)  # type: ignore[arg-type]
        client = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
        try:
            async with asyncio.timeout(10):
                await made  # waits in the kernel's backlog while accepting is paused, then is served
            assert wrapped.failed
            assert "cannot accept a connection" in caplog.text
        finally:
            client.close()
            await listener.close()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
