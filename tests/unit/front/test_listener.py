"""The listening socket accepts a burst of clients in a few loop iterations, on uvloop (the proxy's loop) and on
asyncio's: libuv's own listener takes one connection per iteration, and when every iteration is slow (hundreds of
streams relayed) a burst of 512 streams waited seconds to be accepted (docs/performance.md). Counted in loop
iterations, not seconds: how long an iteration takes is the machine's business (`make bench` measures it)."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

import pytest
import uvloop

from proxy.front.listener import Listener, listening_sockets

CLIENTS = 200
# One accept per iteration needs CLIENTS iterations; a batch of accepts and the hand-overs need a handful.
MOST_ITERATIONS = CLIENTS // 10


class _Counted(asyncio.Protocol):
    def __init__(self, made: list[int], all_made: asyncio.Future[None], iterations: list[int]) -> None:
        self._made = made
        self._all_made = all_made
        self._iterations = iterations

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(self._iterations[0])
        if len(self._made) == CLIENTS:
            self._all_made.set_result(None)


async def _burst(listen: Callable[[socket.socket, Callable[[], asyncio.Protocol]], object]) -> int:
    """Loop iterations from the burst's connects (all queued in the kernel's backlog before the loop looks) until
    the last of its connections is made."""
    loop = asyncio.get_running_loop()
    made: list[int] = []
    iterations = [0]
    all_made: asyncio.Future[None] = loop.create_future()
    (sock,) = listening_sockets("127.0.0.1", 0)
    sock.listen(1024)
    port = sock.getsockname()[1]
    listener = listen(sock, lambda: _Counted(made, all_made, iterations))
    running = True

    def count() -> None:
        iterations[0] += 1
        if running:
            loop.call_soon(count)

    clients: list[socket.socket] = []
    try:
        # Blocking connects on the loop's own thread: the kernel completes them from the backlog meanwhile, and the
        # loop sees all of them queued at its next poll.
        clients.extend(socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(CLIENTS))
        loop.call_soon(count)
        try:
            async with asyncio.timeout(10):
                await all_made
        except TimeoutError:
            pytest.fail(f"{len(made)} of {CLIENTS} connections accepted within 10 s ({iterations[0]} iterations)")
        return max(made)
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
def test_a_burst_of_clients_is_accepted_in_a_few_loop_iterations(loop_factory):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        iterations = runner.run(_burst(Listener))
    assert iterations <= MOST_ITERATIONS, iterations


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
