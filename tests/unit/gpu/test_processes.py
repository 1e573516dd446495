"""Which processes are one engine (proxy/gpu/processes.py), read from the real /proc of this machine: a process
listening on a port that has spawned a child, as vLLM's API server spawns its EngineCore."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from proxy.gpu.processes import EngineProcesses

SERVER = """
import socket, subprocess, sys, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(listener.getsockname()[1], child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def engine() -> Iterator[tuple[int, int, int]]:
    """A stand-in engine: (its port, its pid, its child's pid)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port, child = (int(x) for x in proc.stdout.readline().split())
        yield port, proc.pid, child
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_process_listening_on_the_port_and_its_children_are_the_engine(engine: tuple[int, int, int]) -> None:
    port, pid, child = engine
    assert EngineProcesses(port).pids() == {pid, child}


def test_a_port_nobody_listens_on_is_no_process() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert EngineProcesses(port).pids() == frozenset()


def test_the_processes_are_found_again_once_one_of_them_is_gone(engine: tuple[int, int, int]) -> None:
    port, pid, child = engine
    processes = EngineProcesses(port)
    assert processes.pids() == {pid, child}
    subprocess.run(["kill", str(child)], check=True)  # a worker that died: a zombie until reaped, holding nothing
    deadline = time.monotonic() + 10
    while processes.pids() != {pid}:
        assert time.monotonic() < deadline, processes.pids()
        time.sleep(0.05)
