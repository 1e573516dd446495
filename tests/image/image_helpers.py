"""Small helpers for the image and pod tests: podman commands, HTTP with a deadline, a pod's netns.

Run by scripts/test-image.sh (`make test-image`), which sets up podman (CONTAINERS_CONF,
CONTAINERS_STORAGE_CONF) and builds the images first; without LIFEGUARD_TEST_IMAGE the tests skip.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def required_env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        if os.environ.get("CHECK_IMAGE") == "1":
            pytest.fail(f"{name} is not set; scripts/test-image.sh sets it")
        pytest.skip(f"{name} not set: run `make test-image`")
    return value


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def inspect(name: str, template: str) -> str:
    return podman("inspect", "--format", template, name).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T:
    """Poll `probe` until it returns something other than None (or False); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (OSError, http.client.HTTPException) as error:
            last = error
        else:
            if last is not None and last is not False:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: Any

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.body!r})"


def _enter_netns(pid: int) -> None:
    """Move the calling thread (only it: namespaces are per thread) into the network ns of `pid`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace of pid {pid}")
    finally:
        os.close(fd)


@dataclass
class Client:
    """HTTP/1.1 to host:port, from this machine's loopback or from inside a pod's network namespace."""

    port: int
    host: str = "127.0.0.1"
    netns_pid: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Response:
        return self.start(method, path, body, timeout).result(timeout + 5)

    def start(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Future[Response]:
        """The request in its own thread (so a held request can wait while the test goes on)."""
        future: Future[Response] = Future()

        def run() -> None:
            try:
                if self.netns_pid is not None:
                    _enter_netns(self.netns_pid)
                future.set_result(self._send(method, path, body, timeout))
            except BaseException as error:  # handed to the caller through the future
                future.set_exception(error)

        threading.Thread(target=run, daemon=True).start()
        return future

    def _send(self, method: str, path: str, body: Any, timeout: float) -> Response:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = dict(self.headers)
            if payload is not None:
                headers["Content-Type"] = "application/json"
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read()
            try:
                parsed: Any = json.loads(raw) if raw else None
            except ValueError:
                parsed = raw.decode(errors="replace")
            return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, parsed)
        finally:
            connection.close()

    def get(self, path: str, timeout: float = 30) -> Response:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 30) -> Response:
        return self.request("POST", path, body, timeout=timeout)

    def state(self) -> dict[str, Any]:
        response = self.get("/lifeguard/state")
        assert response.status == 200, response
        state: dict[str, Any] = response.body
        return state

    def wait_state(
        self, wanted: str, timeout: float, check: Callable[[dict[str, Any]], bool] = lambda s: True
    ) -> dict[str, Any]:
        return wait_for(
            f"lifeguard state {wanted}",
            lambda: s if (s := self.state())["state"] == wanted and check(s) else None,
            timeout,
        )

    def wait_held(self, count: int, timeout: float = 10) -> dict[str, Any]:
        return wait_for(
            f"{count} held request(s)", lambda: s if (s := self.state())["held_requests"] == count else None, timeout
        )


def completion_body(model: str = "tiny", max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "temperature": 0}


def report(name: str, value: Any) -> None:
    """A figure for the run's summary (scripts/test-image.sh prints the file at the end)."""
    path = os.environ.get("LIFEGUARD_IMAGE_REPORT")
    if path:
        with Path(path).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({name: value}) + "\n")
