"""The command line as a user runs it: a real process, a real signal."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp

from proxy.cli import loopback_only

BIN = Path(sys.executable).with_name("vllm-lifeguard")
#: Every request here has a deadline inside pytest's 120 s (aiohttp's own default is 300 s).
TIMEOUT = aiohttp.ClientTimeout(total=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_running(base: str, proc: asyncio.subprocess.Process, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        while time.monotonic() < deadline:
            assert proc.returncode is None, "the proxy exited"
            try:
                async with session.get(f"{base}/lifeguard/state") as resp:
                    if (await resp.json())["state"] == "RUNNING":
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the proxy never reported RUNNING")


async def test_a_bad_setting_stops_the_start_with_a_message_naming_it() -> None:
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "serve", "--upstream", "localhost:8000", stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"upstream" in err and b"http://" in err


async def test_serve_without_an_upstream_exits_2_naming_the_setting() -> None:
    """Was: it silently started the simulator, so a sidecar whose LIFEGUARD_UPSTREAM was forgotten reported
    ready in front of a fake engine."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIFEGUARD_UPSTREAM", "LIFEGUARD_CONFIG")}
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "serve", "--port", str(free_port()), stderr=asyncio.subprocess.PIPE, env=env
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"LIFEGUARD_UPSTREAM" in err and b"--upstream sim" in err


async def test_sigterm_answers_held_requests_503_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LIFEGUARD_PORT": str(port), "LIFEGUARD_GPU_PROBE": "none"}
    log = (tmp_path / "log").open("wb")
    proc = await asyncio.create_subprocess_exec(str(BIN), "serve", "--upstream", "sim", stdout=log, stderr=log, env=env)
    try:
        await wait_running(base, proc)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            assert (await session.post(f"{base}/sleep")).status == 200
            held = asyncio.ensure_future(
                session.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            )
            async with asyncio.timeout(10):
                while (await (await session.get(f"{base}/lifeguard/state")).json())["held_requests"] != 1:
                    await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            resp = await asyncio.wait_for(held, 10)
            assert resp.status == 503
            assert resp.headers["X-Lifeguard-Reason"] == "shutting_down"
            resp.release()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
    text = (tmp_path / "log").read_text()
    assert "embedded vLLM simulator" in text


async def test_serve_with_engines_swaps_two_simulator_processes_on_one_gpu_file(tmp_path: Path) -> None:
    """`engines:` from a config file, two simulator processes sharing one GPU file: a request for the sleeping
    model swaps it in; SIGTERM still exits 0."""
    gpu = tmp_path / "gpu.json"
    sizes = ["--weights-gib", "16", "--kv-gib", "32", "--overhead-gib", "2", "--total-gib", "80"]
    ports = {"a": free_port(), "b": free_port()}
    log = (tmp_path / "log").open("wb")
    procs = [
        await asyncio.create_subprocess_exec(
            str(BIN),
            "sim",
            "--port",
            str(ports[name]),
            "--model",
            f"model-{name}",
            "--gpu-file",
            str(gpu),
            "--gpu-file-engine",
            name,
            *sizes,
            stdout=log,
            stderr=log,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "lifeguard.yaml"
    config.write_text(
        f"port: {port}\ngpu_probe: 'file:{gpu}'\nreconcile_interval_s: 0.2\nengines:\n"
        + "".join(f"  - {{name: {n}, upstream: 'http://127.0.0.1:{p}', gpus: [0]}}\n" for n, p in ports.items())
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")}
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await _until_ok(session, [f"http://127.0.0.1:{p}/health" for p in ports.values()], procs)
            assert (await session.post(f"http://127.0.0.1:{ports['b']}/sleep?level=1")).status == 200
            procs.append(
                await asyncio.create_subprocess_exec(
                    str(BIN), "serve", "--config", str(config), stdout=log, stderr=log, env=env
                )
            )
            await _until_ok(session, [f"{base}/lifeguard/readyz"], procs)
            body = {"model": "model-b", "prompt": "x", "max_tokens": 2}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            state = await (await session.get(f"{base}/lifeguard/state")).json()
            assert {n: e["state"] for n, e in state["engines"].items()} == {"a": "SLEEPING", "b": "RUNNING"}
            assert state["gpus"]["0"]["awake"] == ["b"]
        procs[-1].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(procs[-1].wait(), 20) == 0
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        log.close()


async def _until_ok(session: aiohttp.ClientSession, urls: list[str], procs: list[asyncio.subprocess.Process]) -> None:
    deadline = time.monotonic() + 20
    pending = list(urls)
    while pending:
        assert all(proc.returncode is None for proc in procs), "a process exited"
        assert time.monotonic() < deadline, f"not answering 200 within 20 s: {pending}"
        try:
            async with session.get(pending[0]) as resp:
                if resp.status == 200:
                    pending.pop(0)
                    continue
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)


def test_only_loopback_addresses_count_as_closed_to_the_network() -> None:
    assert loopback_only("127.0.0.1") and loopback_only("::1") and loopback_only("[::1]") and loopback_only("localhost")
    assert not loopback_only("0.0.0.0") and not loopback_only("::") and not loopback_only("gpu-node-3")


async def test_serve_on_every_interface_without_a_token_warns_at_start() -> None:
    """The newcomer's `--host 0.0.0.0` with no admin token: vLLM's dev-mode routes would be open to the network."""
    env = {k: v for k, v in os.environ.items() if k != "LIFEGUARD_ADMIN_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "serve", "--upstream", "sim", "--host", "0.0.0.0", "--port", str(free_port()),
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        lines = []
        async with asyncio.timeout(20):
            while not any(b"no admin_token" in line for line in lines):
                line = await proc.stderr.readline()
                assert line, b"".join(lines).decode()
                lines.append(line)
        assert any(b"docs/security.md" in line for line in lines)
    finally:
        proc.terminate()
        await proc.wait()
