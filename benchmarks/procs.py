"""Processes and plain HTTP for the bench: child processes with logs, /proc readings, one-shot requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and of every process below it (the whole process tree), in seconds."""
    total, todo = 0.0, [pid]
    while todo:
        one = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(one)
            todo += children(one)
    return total


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """`pid`'s resident memory now (`VmHWM`: its peak since it started)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


class Proc:
    """A child process with its output in a log file; `stop()` ends it (TERM, then KILL)."""

    def __init__(
        self, name: str, argv: list[str], workdir: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **env} if env else None
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=full_env)
        self.pid = self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# ------------------------------------------------------------------------------------------------ plain HTTP


async def http(port: int, method: str, path: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """One request on its own connection; returns status and body (answers must have a Content-Length)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            raw = await reader.readuntil(b"\r\n\r\n")
            match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", raw)
            payload = await reader.readexactly(int(match.group(1))) if match else b""
        finally:
            writer.close()
    return int(raw.split(b" ", 2)[1]), payload


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what} ({last!r})")


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (TcpExt ListenOverflows)."""
    with contextlib.suppress(OSError), open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            if head.startswith("TcpExt:"):
                return int(dict(zip(head.split(), values.split(), strict=True)).get("ListenOverflows", 0))
    return 0


def median_dict(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of every figure over repeated runs."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def run_ratios(paths: dict[str, list[dict[str, float]]], numerator: str, denominator: str, key: str) -> list[float]:
    """`key` of each repetition on path `numerator` ÷ the same repetition's on `denominator` (the two ran back to
    back in it), sorted; [] when either path did not run. Judged on the spread, not only the median."""
    runs, base = paths.get(numerator), paths.get(denominator)
    if not runs or not base:
        return []
    return sorted(r[key] / b[key] for r, b in zip(runs, base, strict=True) if b[key] > 0)
