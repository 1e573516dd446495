"""The proxy process of the chaos run, and the fault that restarts it: `kill -9` at random moments, then a new
proxy on the same port, as Kubernetes restarts a sidecar that was OOM-killed or updated.

Half of the kills wait for a lifecycle call to be in flight through the proxy (mid-transition: the call's
client sees its connection cut, the engine finishes the call unobserved); the others land wherever the run
is. The new proxy shares nothing with the old one but vLLM and the state file (`LIFEGUARD_STATE_FILE`).
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from tests.chaos.chaos_actors import wait_for_200


class ProxySupervisor:
    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, base: str) -> None:
        self._command = command
        self._env = env
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the supervisor
        self.base = base
        self.proc: subprocess.Popen[bytes] | None = None
        # (killed, listening again) per restart, wall-clock (the Calls' clock): no proxy on the port between.
        self.downtimes: list[tuple[float, float]] = []

    def start(self) -> None:
        self.proc = subprocess.Popen(self._command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self._env)  # fmt: skip

    def kill9(self) -> float:
        killed = time.time()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        return killed

    async def wait_listening(self, session: aiohttp.ClientSession, timeout: float = 20.0) -> None:
        await wait_for_200(session, self.base + "/lifeguard/healthz", timeout, "the restarted proxy (see proxy.log)")

    def stop(self) -> int | None:
        """SIGTERM to the proxy now running: it must shut down cleanly (exit 0)."""
        proc = self.proc
        rc: int | None = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
                    rc = -9
            else:
                rc = proc.returncode
        self._log.close()
        return rc


async def proxy_killer(session: aiohttp.ClientSession, proxy: ProxySupervisor, seed: int, every_s: tuple[float, float],
                       lifecycle_in_flight: Callable[[], bool], stop: asyncio.Event) -> None:  # fmt: skip
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            async with asyncio.timeout(rng.uniform(*every_s)):
                await stop.wait()
            return
        except TimeoutError:
            pass
        if rng.random() < 0.5:  # mid-transition: wait (bounded) for a lifecycle call to be in flight
            deadline = time.monotonic() + 5
            while not lifecycle_in_flight() and time.monotonic() < deadline and not stop.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0, 0.05))
        killed = proxy.kill9()
        proxy.start()
        try:
            await proxy.wait_listening(session)
        finally:
            proxy.downtimes.append((killed, time.time()))
