"""What a newcomer reads first: the log of a clean start, and an engine that cannot be reached, said as a sentence."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Stack
from tests.e2e.test_cli import BIN, free_port, wait_running

# The one warning `serve --upstream sim` means to print: the engine behind it is no vLLM.
MEANT = re.compile(r"not a vLLM \(--upstream sim\)")
LIBRARY_REPR = re.compile(r"\w+Error\(|ConnectionKey|Errno")


async def test_a_clean_start_prints_no_warning_the_proxy_does_not_mean(tmp_path: Path) -> None:
    """Was: 26 lines of `transitions.core Skip binding of 'may_...' to model` before the proxy's first line."""
    port = free_port()
    env = {**os.environ, "LIFEGUARD_PORT": str(port), "LIFEGUARD_GPU_PROBE": "none"}
    log_path = tmp_path / "log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            str(BIN), "serve", "--upstream", "sim", stdout=log, stderr=log, env=env
        )
        try:
            await wait_running(f"http://127.0.0.1:{port}", proc)
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
    lines = log_path.read_text().splitlines()
    unmeant = [line for line in lines if re.search(r"WARNING|ERROR|Traceback", line) and not MEANT.search(line)]
    assert unmeant == [], "\n".join(lines)
    assert any(MEANT.search(line) for line in lines), "\n".join(lines)
    assert not any("transitions" in line for line in lines), "\n".join(lines)


async def test_an_engine_that_refuses_connections_is_said_as_a_sentence(make_stack: Any) -> None:
    """Was: `vLLM could not be reached for POST /update_weights: ClientConnectorError(ConnectionKey(host=...`."""
    stack: Stack = await make_stack()
    address = f"127.0.0.1:{stack.sim_server.port}"
    await stack.sim_server.close()
    inference = await stack.completion()
    lifecycle = await stack.client.post("/sleep?level=1")
    for answer in (inference, lifecycle):
        assert answer.status == 503
        message = (await answer.json())["error"]["message"]
        assert f"connection refused by {address}" in message, message
        assert not LIBRARY_REPR.search(message), message
    state = await stack.wait_for(lambda s: s["state"] == "FAILED")
    assert f"connection refused by {address}" in state["last_error"]["message"]
    assert not LIBRARY_REPR.search(state["last_error"]["message"])
