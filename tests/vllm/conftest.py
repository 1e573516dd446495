"""Real vLLM-for-CPU harness: one vLLM per session, a fresh proxy in front of it per test.

Run through ``make test-vllm`` (``scripts/test-vllm.sh``), which sets up the vLLM venv and exports
``LIFEGUARD_VLLM_PYTHON`` / ``LIFEGUARD_VLLM_MODEL``. Without them every test here is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from scripts.vllm import vllm_server as vllm_server_mod  # `vllm_server` is the session's fixture below
from tests.lifeguard_testing import missing, start_process_group, stop_process_group

REPO = Path(__file__).resolve().parents[2]
STREAM_READ_BUFSIZE = 64 * 2**20  # the session fixture's read buffer (see there)

VllmServer = vllm_server_mod.VllmServer
free_port = vllm_server_mod.free_port


HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's timeout covers the test alone, not its fixtures: the session's vLLM starts in the first test's
    set-up (up to 240 s, VllmServer.start's own deadline) and a dead one is restarted in a reset, and a test's
    timeout must not cut those short and hide which deadline it was. Every fixture here has its own deadline."""
    for item in items:  # this hook sees the whole session's items
        marker = item.get_closest_marker("timeout")
        if HERE in item.path.parents and marker is not None:
            item.add_marker(pytest.mark.timeout(*marker.args, **{**marker.kwargs, "func_only": True}), append=False)


# ---------------------------------------------------------------- sync HTTP helpers (fixtures)


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
    status, raw = http(method, url, body, timeout)
    assert status == 200, f"{method} {url} -> {status} {raw[:300]!r}"
    return json.loads(raw)


# ---------------------------------------------------------------- the vLLM server


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[Any]:
    if not os.environ.get("LIFEGUARD_VLLM_PYTHON") or not os.environ.get("LIFEGUARD_VLLM_MODEL"):
        missing("LIFEGUARD_VLLM_PYTHON/LIFEGUARD_VLLM_MODEL unset: run `make test-vllm`")
    log_dir = Path(os.environ.get("LIFEGUARD_VLLM_LOG_DIR") or tempfile.mkdtemp(prefix="lifeguard-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # --enable-scale-out: test_vllm_clients.py drives SkyRL's generate (/inference/v1/generate).
    server = VllmServer(log_path=log_dir / "vllm.log", extra_args=vllm_server_mod.SUITE_ARGS)
    try:
        server.start()
        sys.stderr.write(f"\n[vllm] healthy on {server.url} after {server.starts[-1]:.1f} s\n")
        yield server
    finally:
        server.stop()
        sys.stderr.write(f"\n[vllm] starts (s): {[round(s, 1) for s in server.starts]}; log {server.log_path}\n")


def reset_vllm(server: Any) -> None:
    """Bring the shared vLLM back to awake, unpaused, idle (restart it if a test killed it)."""
    if not server.alive():
        server.restart()
    base = server.url
    http("POST", base + "/abort_requests", {})
    for path in ("/wake_up", "/resume"):
        status, raw = http("POST", base + path, timeout=30)
        assert status == 200, f"reset {path}: {status} {raw!r}"
    assert http_json("GET", base + "/is_sleeping") == {"is_sleeping": False}
    assert http_json("GET", base + "/is_paused") == {"is_paused": False}
    deadline = time.monotonic() + 10
    while http_json("GET", base + "/load")["server_load"] != 0:
        assert time.monotonic() < deadline, "vLLM still has requests in flight after reset"
        time.sleep(0.05)


# ---------------------------------------------------------------- the proxy


def _started(state: dict[str, Any]) -> bool:
    """One engine: RUNNING. Several (``engines:``): each has been seen, awake or asleep."""
    if "engines" in state:
        return all(engine["state"] in ("RUNNING", "SLEEPING") for engine in state["engines"].values())
    return state.get("state") == "RUNNING"


def lifeguard_bin() -> str:
    exe = Path(sys.executable).parent / "vllm-lifeguard"
    return str(exe) if exe.exists() else "vllm-lifeguard"


@dataclass
class Proxy:
    """``vllm-lifeguard serve --upstream <vLLM>`` (or ``--config FILE`` with ``engines:``) as a subprocess in
    its own process group."""

    port: int
    upstream: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    config: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 30.0, ready: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Spawn the proxy; return once ``GET /lifeguard/state`` says RUNNING, or what `ready` waits for (bounded)."""
        ready = ready or _started
        target = ["--config", str(self.config)] if self.config else ["--upstream", self.upstream]
        cmd = [
            lifeguard_bin(),
            "serve",
            *target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--gpu-probe",
            "none",
            *self.extra_args,
        ]
        t0 = time.monotonic()
        self.proc = start_process_group(
            cmd, self.log_path, self.env, header=f"\n==== start {' '.join(cmd)} env={self.env}"
        )
        deadline = t0 + timeout
        last: Any = None
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"proxy exited rc={self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                status, raw = http("GET", self.url + "/lifeguard/state", timeout=2)
                last = (status, raw[:300])
                if status == 200 and ready(json.loads(raw)):
                    break
            except (OSError, ValueError) as e:
                last = repr(e)
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"proxy not ready after {timeout} s (last {last!r}); log tail:\n{self.log_tail()}")
            time.sleep(0.05)
        self.starts.append(time.monotonic() - t0)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the proxy's process group, SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        stop_process_group(self.proc, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


#: The proxies a test started, whose logs' tails its failure report carries (`pytest_runtest_makereport`).
PROXIES = pytest.StashKey[list[Proxy]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the tail of each proxy's log: the proxy runs apart from the test, and a
    failure that a rerun passes otherwise leaves only its assertion behind (CI keeps no files)."""
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "call" and report.failed:
        for proxy in item.stash.get(PROXIES, []):
            report.sections.append((f"proxy log {proxy.log_path.name}", proxy.log_tail(40)))


@pytest.fixture
def start_proxy(vllm_server: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Proxy]]:
    """Factory: ``start_proxy(LIFEGUARD_X="y")`` resets the shared vLLM, then starts a proxy with that env.
    `reset=False` keeps vLLM as the test left it (a restarted proxy); `ready` as `Proxy.start` takes it."""
    started = request.node.stash[PROXIES] = []  # a rerun starts its own

    def _start(*, reset: bool = True, ready: Callable[[dict[str, Any]], bool] | None = None, **env: str) -> Proxy:
        if reset:
            reset_vllm(vllm_server)
        p = Proxy(port=free_port(), upstream=vllm_server.url, log_path=tmp_path / f"proxy{len(started)}.log", env=env)
        started.append(p)
        p.start(ready=ready)
        return p

    try:
        yield _start
    finally:
        for p in started:
            p.stop()


@pytest.fixture
def proxy(start_proxy: Callable[..., Proxy]) -> Proxy:
    """A fresh proxy with default settings in front of the (reset) shared vLLM."""
    return start_proxy()


def _sdk(url: str) -> AsyncOpenAI:
    """The openai SDK pointed at `url` (no retries: a retry would hide what the proxy did); closed on leaving
    `async with`."""
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
async def oai(proxy: Proxy) -> AsyncIterator[AsyncOpenAI]:
    """The openai SDK pointed at the proxy."""
    async with _sdk(proxy.url) as client:
        yield client


@pytest.fixture
async def oai_direct(vllm_server: Any) -> AsyncIterator[AsyncOpenAI]:
    """The openai SDK pointed at vLLM directly."""
    async with _sdk(vllm_server.url) as client:
        yield client


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # Every request has a deadline inside the shortest test timeout here (180 s): a hang is named, not hidden.
    # While a test reads a 12,000-token stream (~4 MB, one HTTP chunk per event), this process fell seconds behind:
    # the stream's socket full and unread, and a /pause sent meanwhile out of its 5 s to connect (on uvloop and on
    # asyncio's loop alike). read_bufsize: aiohttp pauses reading at 4,096 buffered chunks by default, and once
    # sat idle so (strace: epoll_wait 2.8 s with nothing ready); a buffer larger than any stream here keeps that
    # flow control out. sock_connect 30 s: a loopback connect is the kernel's at once; more is this loop's delay.
    timeout = aiohttp.ClientTimeout(total=150, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=STREAM_READ_BUFSIZE) as s:
        yield s
