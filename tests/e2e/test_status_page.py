"""The status page and `vllm-lifeguard status` against the proxy in front of the simulator (the browser itself is
tests/ui/, `make test-ui`): who gets the page and its data, and the terminal table through a sleep and a wake."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.e2e.conftest import EnginesStack, Stack

TOKEN = "s3cret-admin-token-4f9a"
BIN = Path(sys.executable).with_name("vllm-lifeguard")


def base_url(stack: Stack | EnginesStack) -> str:
    return str(stack.client.make_url("")).rstrip("/")


async def status(*args: str, token: str | None = None, timeout: float = 20) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")}
    if token is not None:
        env["LIFEGUARD_ADMIN_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "status", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"vllm-lifeguard status did not finish within {timeout} s") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ----- the page's door
async def test_signing_in_opens_the_page_and_the_state_but_no_lifecycle_call(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    client = stack.client
    assert (await client.get("/lifeguard/ui")).status == 401
    assert (await client.get("/lifeguard/state")).status == 401
    wrong = await client.post("/lifeguard/ui", data={"token": "wrong"}, allow_redirects=False)
    assert wrong.status == 403 and "Set-Cookie" not in wrong.headers
    signed = await client.post("/lifeguard/ui", data={"token": TOKEN}, allow_redirects=False)
    assert signed.status == 303 and signed.headers["Location"] == "ui"
    assert "HttpOnly" in signed.headers["Set-Cookie"] and "SameSite=Strict" in signed.headers["Set-Cookie"]
    # the client's cookie jar now carries the session, as a browser's would
    page = await client.get("/lifeguard/ui")
    assert page.status == 200 and "<title>vllm-lifeguard</title>" in await page.text()
    assert "script-src 'sha256-" in page.headers["Content-Security-Policy"]
    state = await client.get("/lifeguard/state")
    assert state.status == 200 and (await state.json())["state"] == "RUNNING"
    # a page elsewhere that makes this browser POST /sleep gets nothing done: the session is no admin token
    before = stack.sim_count("sleep")
    refused = await client.post("/sleep", params={"level": "1"})
    assert refused.status == 401
    assert stack.sim_count("sleep") == before and (await stack.state())["state"] == "RUNNING"


async def test_without_a_token_the_page_is_served_to_anyone(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    page = await stack.client.get("/lifeguard/ui")
    assert page.status == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["X-Frame-Options"] == "DENY"


async def test_several_engines_have_the_page_and_the_token_at_the_top_and_per_engine(
    make_engines: Callable[..., Awaitable[EnginesStack]],
) -> None:
    stack = await make_engines(admin_token=TOKEN)
    for prefix in ("", "/engines/a", "/engines/b"):
        assert (await stack.client.get(f"{prefix}/lifeguard/ui")).status == 401, prefix
        assert (await stack.client.get(f"{prefix}/lifeguard/state")).status == 401, prefix
    signed = await stack.client.post("/engines/b/lifeguard/ui", data={"token": TOKEN}, allow_redirects=False)
    assert "Path=/engines/b/lifeguard;" in signed.headers["Set-Cookie"]
    assert (await stack.client.get("/engines/b/lifeguard/ui")).status == 200
    assert (await stack.client.get("/lifeguard/ui", headers={"X-Lifeguard-Token": TOKEN})).status == 200


# ----- the terminal
async def test_status_shows_the_engine_through_a_sleep_and_a_wake(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(admin_token=TOKEN)
    url = base_url(stack)
    code, out, err = await status(url)
    assert code == 1 and out == ""
    assert "needs the admin token" in err and "LIFEGUARD_ADMIN_TOKEN" in err
    code, _, err = await status(url, token="wrong")
    assert code == 1 and "refused the admin token" in err

    code, out, _ = await status(url, token=TOKEN)
    assert code == 0
    assert out.splitlines()[1].split()[:2] == ["default", "RUNNING"]
    assert "STARTING -> RUNNING" in out

    headers = {"X-Lifeguard-Token": TOKEN}
    assert (await stack.client.post("/sleep", params={"level": "1"}, headers=headers)).status == 200
    code, out, _ = await status(url, "--transitions", "2", token=TOKEN)
    row = out.splitlines()[1].split()
    assert row[:2] == ["default", "SLEEPING"] and row[3:5] == ["L1", "kv_cache,weights"]
    assert out.splitlines()[-2:][0].endswith("RUNNING -> FALLING_ASLEEP")
    assert out.splitlines()[-1].endswith("FALLING_ASLEEP -> SLEEPING")

    assert (await stack.client.post("/wake_up", headers=headers)).status == 200
    code, out, _ = await status(url, token=TOKEN)
    assert out.splitlines()[1].split()[:2] == ["default", "RUNNING"]
    assert out.splitlines()[-1].endswith("WAKING -> RUNNING")


async def test_status_of_several_engines_shows_each_the_gpu_and_the_queue(
    make_engines: Callable[..., Awaitable[EnginesStack]],
) -> None:
    stack = await make_engines()
    code, out, _ = await status(base_url(stack))
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:3]}
    assert rows["a"][1] == "RUNNING" and rows["b"][1:2] == ["SLEEPING"]
    assert "GPU 0  " in out and "awake: a" in out
    assert "swap queue: empty" in out
    code, out, _ = await status(base_url(stack) + "/engines/b")
    assert code == 0 and out.splitlines()[1].split()[:2] == ["default", "SLEEPING"]


async def test_status_watch_redraws_until_interrupted(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    # Ctrl-C as a terminal sends it, whatever this test inherited: a shell that starts a job in the background
    # (`.ci/run &`) leaves SIGINT ignored in it and every child, and Python then raises no KeyboardInterrupt.
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "status", base_url(stack), "--watch", "--interval", "0.2", stdout=asyncio.subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stdout is not None
    frames = 0
    deadline = time.monotonic() + 20
    try:
        while frames < 3:
            line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            assert line, "the watch ended by itself"
            frames += line.startswith(b"ENGINE ")
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
