"""The simulator and the proxy as the processes a trainer talks to: `vllm-lifeguard sim` and
`vllm-lifeguard serve` (its default data plane), each on a loopback port of its own.

A trainer whose weight sync blocks its own thread (SkyRL 0.4.0's driver waits on Ray while its workers make
blocking HTTP calls) cannot share an event loop with the servers it calls, so they run apart, as in a pod.
Every wait has a deadline; a server that exits or never comes up fails the test with the tail of its log.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.clients.reads import StackReads

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 30.0
# A request the proxy holds by mistake (a deadlock in a trainer's sync) fails within seconds, not 300 s.
HOLD_TIMEOUT_S = 8.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} log ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _spawn(name: str, args: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )


@dataclass
class ProcessStack(StackReads):
    """A simulator and the proxy in front of it; `url` is what the trainer is pointed at."""

    sim: Server
    proxy: Server
    servers: list[Server] = field(default_factory=list)
    get_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        self.url = self.proxy.url
        self.sim_url = self.sim.url

    def logs(self) -> str:
        return "\n".join(server.tail() for server in (self.sim, self.proxy))

    async def set_faults(self, *specs: str) -> None:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{self.sim_url}/sim/faults", json=list(specs)) as response:
                assert response.status == 200, await response.text()

    def stop(self) -> None:
        for server in (self.proxy, self.sim):
            server.stop()


async def start_stack(tmp_path: Path, sim_args: Sequence[str] = (), **proxy_env: str) -> ProcessStack:
    """`vllm-lifeguard sim` (with `sim_args`) and `vllm-lifeguard serve` in front of it (`proxy_env`: settings as
    LIFEGUARD_* names without the prefix), both up and the proxy RUNNING."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")}
    env["PYTHONUNBUFFERED"] = "1"
    gpu_file = tmp_path / "gpu.json"
    sim_port, proxy_port = free_port(), free_port()
    sim_log, proxy_log = tmp_path / "sim.log", tmp_path / "proxy.log"
    sim = Server(
        "sim",
        _spawn(
            "sim",
            ["sim", "--port", str(sim_port), "--gpu-file", str(gpu_file), "--token-seconds", "0.002", *sim_args],
            sim_log,
            env,
        ),
        f"http://127.0.0.1:{sim_port}",
        sim_log,
    )
    proxy_env = {"hold_timeout_s": str(HOLD_TIMEOUT_S), **proxy_env}
    env_proxy = {**env, **{f"LIFEGUARD_{k.upper()}": v for k, v in proxy_env.items()}}
    upstream = ["--upstream", sim.url, "--port", str(proxy_port), "--gpu-probe", f"file:{gpu_file}"]
    proxy_process = _spawn("proxy", ["serve", *upstream], proxy_log, env_proxy)
    proxy = Server("proxy", proxy_process, f"http://127.0.0.1:{proxy_port}", proxy_log)
    stack = ProcessStack(sim, proxy)
    try:
        await _until_running(stack)
    except BaseException:
        stack.stop()
        raise
    return stack


async def _until_running(stack: ProcessStack) -> None:
    deadline = asyncio.get_running_loop().time() + START_DEADLINE_S
    while True:
        for server in (stack.sim, stack.proxy):
            if server.process.poll() is not None:
                raise AssertionError(f"{server.name} exited with {server.process.returncode}\n{stack.logs()}")
        try:
            if (await stack.proxy_state())["state"] == "RUNNING":
                return
        except (aiohttp.ClientError, AssertionError, OSError):
            pass
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"the proxy was not RUNNING within {START_DEADLINE_S:g} s\n{stack.logs()}")
        await asyncio.sleep(0.1)
