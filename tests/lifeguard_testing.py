"""The proxy as `vllm-lifeguard serve` runs it, for aiohttp's test client, and the deadline every test
client's request has (tests/conftest.py applies it): shared by every test directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest
from aiohttp.test_utils import BaseTestServer, TestClient
from yarl import URL

from proxy.app import Lifeguard
from proxy.config import Settings


def missing(component: str) -> NoReturn:
    """A component this test needs is not installed. Outside CI: a skip that says so. In CI (CI=true) every group
    installs what its tests need, so a missing component is a failed install, and the test fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{component} (CI=true: a missing component fails, it does not skip)", pytrace=False)
    pytest.skip(f"{component} (outside CI only: CI=true fails here)")


def without_lifeguard_env(monkeypatch: pytest.MonkeyPatch, *, keep: frozenset[str] = frozenset()) -> None:
    """Unset every LIFEGUARD_* variable but those in `keep`: a developer's own would otherwise win over what the
    test sets up (the config file, the settings it passes) and mask a mismatch."""
    for name in list(os.environ):
        if name.upper().startswith("LIFEGUARD_") and name not in keep:
            monkeypatch.delenv(name)


#: The deadline of every request a test client sends unless the test sets its own: well inside pytest's 120 s.
CLIENT_TIMEOUT_S = 60.0


def client_timeout(total: float = CLIENT_TIMEOUT_S) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total)


class LifeguardServer(BaseTestServer):
    """A `Lifeguard` listening on loopback, for aiohttp's TestClient (`client.server.lifeguard`)."""

    def __init__(self, settings: Settings, **lifeguard: Any) -> None:
        super().__init__()
        self.settings = settings
        self.lifeguard = Lifeguard(settings, **lifeguard)

    async def _make_runner(self, **kwargs: Any) -> Any:
        raise NotImplementedError("a Lifeguard runs no aiohttp server")

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        if self.started:
            return
        await self.lifeguard.start(self.host, 0)
        self.port = self.lifeguard.port
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    @property
    def started(self) -> bool:
        return self.lifeguard.engine_set is not None

    async def close(self) -> None:
        if self.started and not self.closed:
            await self.lifeguard.close()
            self._root = None
            self._closed = True


#: `await serve_lifeguard(settings)` (tests/conftest.py): the proxy listening, and a client for it.
ServeLifeguard = Callable[..., Awaitable[TestClient[Any, Any]]]


async def stream_under_way(
    counted: Awaitable[object], first_token: asyncio.Event, *, load: str, detail: Callable[[], str] | None = None
) -> None:
    """A long stream has reached the engine: its first token came (`first_token` is set), or the engine's GET /load
    counts it (`counted` returns; then the first token gets a second more). An engine short of CPU can deliver the
    first token when the stream is nearly done (seen: all of it at once), and a pause, sleep or kill sent only then
    finds it finished (a rehearsal: finish_reason 'length', not 'abort'). `load` names the /load read in a
    failure, `detail()` (what the stream saw by then) follows it."""
    counted_task = asyncio.ensure_future(counted)
    started = asyncio.ensure_future(first_token.wait())
    try:
        done, _ = await asyncio.wait({counted_task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done, f"the stream reached neither {load} nor the client in 30 s" + (f": {detail()}" if detail else "")
        if started not in done:
            counted_task.result()  # a failed /load read fails here
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started, 1.0)
    finally:
        for task in (counted_task, started):
            task.cancel()
        await asyncio.gather(counted_task, started, return_exceptions=True)


def start_process_group(
    argv: list[str], log_path: Path, env: dict[str, str], *, header: str
) -> subprocess.Popen[bytes]:
    """`argv` in a session of its own (its process group: stop_process_group stops exactly what it started), with
    `env` over this process's environment, no stdin, its output appended to `log_path` after the line `header`."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        log.write(f"{header}\n".encode())
        log.flush()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def stop_process_group(process: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM a process started in a session of its own (its process group), SIGKILL after `timeout` s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)


# The kernel's socket diagnostics over netlink (linux/sock_diag.h, linux/inet_diag.h): SOCK_DIAG_BY_FAMILY, a dump
# of the TCP sockets in LISTEN with their memory info (INET_DIAG_SKMEMINFO), whose SK_MEMINFO_DROPS is the socket's
# own sk_drops. A listener's sk_drops counts every connect it turned away (tcp_listendrop: a full accept queue, also
# a full SYN queue), what TcpExt ListenOverflows counts for the whole machine: `ss -ltnm` shows it as skmem's `d`.
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_DONE, _NLMSG_ERROR = 4, 20, 3, 2
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_TCP_LISTEN, _INET_DIAG_SKMEMINFO, _SK_MEMINFO_DROPS = 10, 7, 8
_INET_DIAG_MSG = struct.Struct("=BBBBHH16s16sIQIIIII")  # 72 bytes: family, .., sport, dport (big-endian), .., inode


def listen_drops(port: int) -> int:
    """How many connects the TCP listener on `port` (IPv4) has turned away, as the kernel counts them for that
    socket alone: a count other processes on the machine cannot move."""
    request = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 1 << (_INET_DIAG_SKMEMINFO - 1), 0,
                          1 << _TCP_LISTEN) + bytes(48)  # fmt: skip
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: list[int] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        diag.sendall(header + request)
        while True:
            data, offset = diag.recv(1 << 16), 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    if len(found) != 1:
                        raise AssertionError(f"{len(found)} TCP listeners on port {port}, not one")
                    return found[0]
                if kind == _NLMSG_ERROR:
                    errno = -struct.unpack_from("=i", data, offset + 16)[0]
                    raise AssertionError(f"sock_diag refused the dump: errno {errno}")
                message = data[offset + 16 : offset + length]
                if struct.unpack_from(">H", message, 4)[0] == port:
                    found.append(_skmem_drops(message[_INET_DIAG_MSG.size :]))
                offset += (length + 3) & ~3


def _skmem_drops(attributes: bytes) -> int:
    offset = 0
    while offset + 4 <= len(attributes):
        length, kind = struct.unpack_from("=HH", attributes, offset)
        if kind == _INET_DIAG_SKMEMINFO:
            return int(struct.unpack_from("=I", attributes, offset + 4 + 4 * _SK_MEMINFO_DROPS)[0])
        offset += (length + 3) & ~3
    raise AssertionError("the kernel sent no memory info (INET_DIAG_SKMEMINFO) for the listener")
