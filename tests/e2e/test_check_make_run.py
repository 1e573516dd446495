"""What a newcomer does: `make run` (`vllm-lifeguard serve --upstream sim`), then `vllm-lifeguard check
http://127.0.0.1:PORT --lifecycle`, both real processes: the whole matrix, both columns, in under a minute."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from tests.e2e.test_cli import BIN, free_port, wait_running

#: The promise of docs/check.md: the matrix in under a minute against `make run`.
MATRIX_DEADLINE_S = 60.0


async def test_check_lifecycle_against_make_run_gives_the_matrix_in_under_a_minute(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LIFEGUARD_PORT": str(port), "LIFEGUARD_GPU_PROBE": "none", "NO_COLOR": "1"}
    with (tmp_path / "serve.log").open("wb") as log:
        serve = await asyncio.create_subprocess_exec(
            str(BIN), "serve", "--upstream", "sim", stdout=log, stderr=log, env=env
        )
    try:
        await wait_running(base, serve)
        started = time.monotonic()
        check = await asyncio.create_subprocess_exec(
            str(BIN), "check", base, "--lifecycle", "--gpu-probe", "none",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(check.communicate(), MATRIX_DEADLINE_S)
        finally:
            if check.returncode is None:
                check.kill()
                await check.wait()
        took = time.monotonic() - started
        assert check.returncode == 0, (out + err).decode()[-3000:]
        text = out.decode()
        # LoRA, GPU, the checkpoint and the kept tier (make run serves vLLM 0.33), the stall (stall_after_s is off)
        assert re.search(r"through the lifeguard: \d+ green, 0 red, 5 skip", text), text[-1500:]
        assert "wake-unknown-tag" in text and took < MATRIX_DEADLINE_S
    finally:
        serve.terminate()
        await asyncio.wait_for(serve.wait(), 20)
