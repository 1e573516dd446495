"""lifeguard_testing.listen_drops, the count behind the front's and vLLM's "no connect turned away" checks: per
listening socket, so that another process's overflowing listener on the same machine moves nothing."""

from __future__ import annotations

import socket
import time

import pytest

from tests.lifeguard_testing import listen_drops


def _overflow(port: int, connects: int) -> list[socket.socket]:
    """Non-blocking connects to a listener that accepts none: the kernel keeps backlog + 1, turns the rest away."""
    clients = []
    for _ in range(connects):
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        clients.append(client)
    return clients


def test_only_the_listener_whose_queue_overflowed_counts_its_turned_away_connects() -> None:
    full, quiet = socket.socket(), socket.socket()
    clients: list[socket.socket] = []
    try:
        for listener in (full, quiet):
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
        ports = full.getsockname()[1], quiet.getsockname()[1]
        assert [listen_drops(port) for port in ports] == [0, 0]
        clients = _overflow(ports[0], 6)
        deadline = time.monotonic() + 10  # a SYN turned away is counted when it arrives; loopback delivers at once
        while listen_drops(ports[0]) == 0:
            assert time.monotonic() < deadline, "the full listener never counted a connect turned away"
            time.sleep(0.01)
        assert listen_drops(ports[1]) == 0
    finally:
        for sock in (*clients, full, quiet):
            sock.close()


def test_a_port_with_no_listener_is_an_error_not_zero() -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))  # bound, not listening
        with pytest.raises(AssertionError, match="0 TCP listeners on port"):
            listen_drops(bound.getsockname()[1])
