"""The status page in Debian's headless Chromium, in front of the proxy and the simulator: the rendered DOM follows a
sleep and a wake (the engine's state text RUNNING -> SLEEPING -> RUNNING, the transitions drawn on the timeline),
several engines show their lanes, GPU bar, lock and swap queue; screenshots are kept in the artefacts folder."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.conftest import MEDIUM, EnginesStack, Stack, held_until
from tests.e2e.test_cli import BIN, free_port, wait_running
from tests.ui.chromium import Page, chromium

TOKEN = "s3cret-admin-token-4f9a"
GIB = 1 << 30


def base_url(stack: Stack | EnginesStack) -> str:
    return str(stack.client.make_url("")).rstrip("/")


def state_text(engine: str) -> str:
    return f"(document.querySelector('[data-engine={json.dumps(engine)}] .state')?.textContent ?? null)"


def transitions(engine: str) -> str:
    return (
        f"[...document.querySelectorAll('#timeline [data-transition][data-engine={json.dumps(engine)}]')]"
        ".map(t => t.dataset.from + '>' + t.dataset.to)"
    )


def held_count(engine: str) -> str:
    return f"(document.querySelector('[data-engine={json.dumps(engine)}] [data-count=\"held\"] b')?.textContent)"


async def refreshes(page: Page) -> int:
    return int(await page.evaluate("Number(document.body.dataset.refreshes || 0)"))


async def watch_until(page: Page, engine: str, wanted: str, seen: list[str], timeout: float = 15.0) -> None:
    """Poll the engine's state text until it reads `wanted`, noting each change in `seen`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = await page.evaluate(state_text(engine))
        if not seen or seen[-1] != text:
            seen.append(text)
        if text == wanted:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the page never showed {engine} {wanted} within {timeout} s; it showed {seen}")
        await asyncio.sleep(0.05)


async def sign_in(page: Page, url: str) -> None:
    await page.navigate(url)
    assert await page.evaluate("document.title") == "vllm-lifeguard: sign in"
    # Before signing in, the data is refused to this browser too.
    assert await page.evaluate("fetch('state').then(r => r.status)") == 401
    fill = f"document.getElementById('token').value = {json.dumps(TOKEN)}; document.forms[0].submit(); true"
    await page.load(lambda: page.evaluate(fill))
    page.problems.clear()  # the sign-in form's own 401 (and the fetch above) are logged as failed loads
    assert await page.evaluate("document.title") == "vllm-lifeguard"


async def test_the_page_follows_a_sleep_and_a_wake(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path, artifacts: Path
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    assert (await stack.client.get("/lifeguard/ui")).status == 401
    assert (await stack.client.get("/lifeguard/state")).status == 401
    admin = {"X-Lifeguard-Token": TOKEN}
    async with chromium(tmp_path / "profile", artifacts / "chromium-one-engine.log") as page:
        await sign_in(page, base_url(stack) + "/lifeguard/ui")
        assert await page.evaluate("document.cookie") == ""  # HttpOnly: the page's script cannot read the session
        await page.wait_for("Number(document.body.dataset.refreshes) >= 2", "two refreshes")
        seen: list[str] = []
        await watch_until(page, "default", "RUNNING", seen)

        assert (await stack.client.post("/sleep", params={"level": "1"}, headers=admin)).status == 200
        before = await refreshes(page)
        await watch_until(page, "default", "SLEEPING", seen)
        tags = await page.evaluate(
            "[...document.querySelectorAll('[data-engine=\"default\"] .tag')].map(t => t.textContent)"
        )
        assert "sleep level 1" in tags and "asleep: kv_cache, weights" in tags
        await page.wait_for(f"Number(document.body.dataset.refreshes) >= {before + 2}", "refreshes while asleep")
        assert await page.evaluate(state_text("default")) == "SLEEPING"

        # A request held while asleep, and a wake that vLLM fails (500, out of memory): still asleep, the error listed.
        held = asyncio.ensure_future(stack.completion())
        await page.wait_for(f"{held_count('default')} === '1'", "one held request")
        stack.faults("wake_up:error500@1")
        assert (await stack.client.post("/wake_up", headers=admin)).status == 503
        error = await page.wait_for(
            "(r => r && [r.dataset.error, r.textContent])(document.querySelector('#errors [data-error]'))", "the error"
        )
        assert error[0] == "upstream_error" and "out of memory" in error[1]
        assert await page.evaluate(state_text("default")) == "SLEEPING"

        assert (await stack.client.post("/wake_up", headers=admin)).status == 200
        await watch_until(page, "default", "RUNNING", seen)
        assert (await asyncio.wait_for(held, 15)).status == 200
        await page.wait_for(f"{held_count('default')} === '0'", "the held request released")
        steady = [s for s in seen if s in ("RUNNING", "SLEEPING")]
        settled = [s for n, s in enumerate(steady) if steady[n - 1 : n] != [s]]
        assert settled == ["RUNNING", "SLEEPING", "RUNNING"], seen

        drawn = await page.wait_for(f"(t => t.at(-1) === 'WAKING>RUNNING' && t)({transitions('default')})", "the wake")
        expected = iter(["RUNNING>FALLING_ASLEEP", "FALLING_ASLEEP>SLEEPING", "SLEEPING>WAKING", "WAKING>RUNNING"])
        step = next(expected)
        for tick in drawn:  # in this order on the timeline, whatever else is between them
            if tick == step and (step := next(expected, None)) is None:
                break
        assert step is None, drawn
        verification = await page.evaluate(
            "(v => v && [v.dataset.verification, [...v.querySelectorAll('[data-check]')].map(c => c.dataset.check)])"
            "(document.querySelector('[data-engine=\"default\"] .verify'))"
        )
        assert verification == ["passed", ["health", "flags", "memory", "canary"]]
        assert await page.evaluate("document.querySelector('[data-gpu] [data-segment=\"default\"]') !== null")
        await page.screenshot(artifacts / "status-page-one-engine.png")
        assert page.problems == []


async def test_make_run_shows_one_engine_as_the_readme_does(tmp_path: Path, artifacts: Path) -> None:
    """`make run` (`vllm-lifeguard serve --upstream sim`, a process) after the README's sleep, held request and wake:
    one engine, RUNNING, verified, its GPU line unread here. Its screenshot is the README's (docs/status-page.png);
    was: the README showed three engines mid-swap, which `make run` never shows."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LIFEGUARD_PORT": str(port)}
    with (tmp_path / "serve.log").open("wb") as log:
        serve = await asyncio.create_subprocess_exec(str(BIN), "serve", "--upstream", "sim", stdout=log, stderr=log,
                                                     env=env)  # fmt: skip
    try:
        await wait_running(base, serve)
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            aiohttp.ClientSession(base, timeout=timeout) as client,
            chromium(tmp_path / "profile", artifacts / "chromium-make-run.log") as page,
        ):
            await page.navigate(base + "/lifeguard/ui")
            await page.wait_for(f"{state_text('default')} === 'RUNNING'", "the engine RUNNING")
            assert (await client.post("/sleep", params={"level": "1"})).status == 200
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
            held = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await page.wait_for(f"{held_count('default')} === '1'", "one held request")
            # Asleep for a few of the page's own refreshes, so that the timeline shows the sleep it drew.
            await page.wait_for(f"Number(document.body.dataset.refreshes) >= {await refreshes(page) + 3}", "refreshes")
            assert (await client.post("/wake_up")).status == 200
            assert (await asyncio.wait_for(held, 15)).status == 200
            await page.wait_for(f"(t => t.at(-1) === 'WAKING>RUNNING' && t)({transitions('default')})", "the wake")
            await page.wait_for(f"{held_count('default')} === '0'", "the held request released")
            engines = "new Set([...document.querySelectorAll('[data-engine]')].map(e => e.dataset.engine)).size"
            assert await page.evaluate(engines) == 1
            verified = "document.querySelector('[data-engine=\"default\"] .verify').dataset.verification"
            assert await page.evaluate(verified) == "passed"
            await page.screenshot(artifacts / "status-page-make-run.png")
            assert page.problems == []
    finally:
        serve.terminate()
        await asyncio.wait_for(serve.wait(), 20)


async def test_several_engines_show_lanes_the_gpu_lock_and_the_swap_queue(
    make_engines: Callable[..., Awaitable[EnginesStack]], tmp_path: Path, artifacts: Path
) -> None:
    names = ("policy", "judge", "reward")
    footprint = {"footprint_gib": 38}  # known to the arbiter: it makes room for one wake, not for every engine
    stack = await make_engines(names, asleep=("judge", "reward"), sizes=MEDIUM, engine={n: footprint for n in names})
    # The judge's wake waits for the test, so the queue behind it can be seen: it holds GPU 0, the reward waits.
    release = asyncio.Event()
    judge = stack.sim("judge")
    judge.wake_up = held_until(release, judge.wake_up, timeout=30)  # type: ignore[method-assign]
    async with chromium(tmp_path / "profile", artifacts / "chromium-engines.log") as page:
        await page.navigate(base_url(stack) + "/lifeguard/ui")
        await page.wait_for("Number(document.body.dataset.refreshes) >= 1", "a first refresh")
        assert await page.evaluate("[...document.querySelectorAll('[data-lane]')].map(l => l.dataset.lane)") == [
            "policy", "judge", "reward",
        ]  # fmt: skip
        judged = asyncio.ensure_future(stack.completion("model-judge"))
        await stack.wait_for(lambda s: any(t["engine"] == "judge" and t["running"] for t in s["swap_queue"]))
        rewarded = asyncio.ensure_future(stack.completion("model-reward"))
        await stack.wait_for(lambda s: any(t["engine"] == "reward" and not t["running"] for t in s["swap_queue"]))
        turns = await page.wait_for(
            "(t => t.length === 2 && t)([...document.querySelectorAll('[data-turn]')].map(r => r.dataset.turn))",
            "the swap queue with two engines",
        )
        assert turns == ["judge", "reward"]
        assert await page.evaluate("document.querySelector('[data-gpu=\"0\"] [data-lock]').dataset.lock") == (
            "judge (wake_up)"
        )
        assert await page.evaluate(state_text("judge")) == "WAKING"
        await page.screenshot(artifacts / "status-page-engines.png")

        release.set()
        assert (await asyncio.wait_for(judged, 30)).status == 200
        assert (await asyncio.wait_for(rewarded, 30)).status == 200
        await page.wait_for(
            f"{state_text('reward')} === 'RUNNING' && {state_text('judge')} === 'RUNNING'", "both woken"
        )
        await page.wait_for("document.querySelectorAll('[data-turn]').length === 0 && true", "an empty queue")
        asleep = await page.evaluate(state_text("policy"))
        assert asleep == "SLEEPING"  # the least recently used made room for the reward (two fit, not three)
        for engine, last in (
            ("policy", "FALLING_ASLEEP>SLEEPING"),
            ("judge", "WAKING>RUNNING"),
            ("reward", "WAKING>RUNNING"),
        ):
            assert (await page.evaluate(transitions(engine)))[-1] == last, engine
        segments = await page.evaluate(
            "[...document.querySelectorAll('[data-gpu=\"0\"] [data-segment]')].map(s => s.dataset.segment)"
        )
        assert {"judge", "reward"} <= set(segments)
        await page.screenshot(artifacts / "status-page-engines-after.png")
        assert page.problems == []
    assert stack.violations() == {}


# ----- the page against states served by the test: the one-front shape, hostile text, a failing state
HOSTILE = '<img src=x onerror="window.pwned = 1"><script>window.pwned = 2</script>'


def flat_engine(at: float) -> dict[str, Any]:
    return {
        "state": "RUNNING",
        "since": at - 20,
        "sleep_level": None,
        "asleep_tags": [],
        "paused": False,
        "weights_stale": True,
        "weights_stale_reason": "restarted",
        "last_error": {"reason": "engine_restarted", "message": HOSTILE, "at": at - 5},
        "recent_errors": [{"reason": "engine_restarted", "message": HOSTILE, "at": at - 5, "count": 2}],
        "transitions": [{"from": "FAILED", "to": "RUNNING", "at": at - 20}],
        "history_since": at - 40,
        "drift_events": [],
        "read_at": at,
        "held_requests": 0,
        "inflight_requests": 4,
        "last_verification": None,
        "gpu_memory": {"available": True, "devices": [{"gpu": "0", "used_bytes": 40 << 30, "total_bytes": 80 << 30}]},
        "upstream": HOSTILE,
        # what the one-front rewrite adds to an engine's snapshot
        "name": "default",
        "gpus": [0],
        "pinned": False,
        "models": ["tiny"],
        "base_url": "/engines/default/",
    }


async def serve_page(aiohttp_server: Any, state: Callable[[], tuple[int, Any]]) -> Any:
    """The page as the proxy answers it, beside a `/lifeguard/state` that answers what `state()` says."""
    import time

    from aiohttp import web

    from proxy.front.status_page import PAGE_PATH, page_answer

    async def page(request: web.Request) -> web.Response:
        answer = page_answer(list(request.raw_headers), None, request.path, time.time())
        response = web.Response(status=answer.status, body=answer.body, content_type="text/html")
        response.headers.update({name.decode(): value.decode() for name, value in answer.headers})
        return response

    async def state_answer(request: web.Request) -> web.Response:
        status, body = state()
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get(PAGE_PATH, page)
    app.router.add_get("/lifeguard/state", state_answer)
    return await aiohttp_server(app)


async def test_a_gpu_held_by_another_pods_lifeguard_is_labelled_with_its_engine_operation_and_host(
    aiohttp_server: Any, tmp_path: Path, artifacts: Path
) -> None:
    """One engine of a pod beside others on the node (gpu_lock_dir): the state's `gpu_lock` says another pod's
    lifeguard holds GPU 0 for a wake; the GPU's bar says who, where the swap queue of this proxy is empty."""
    import time

    engine = flat_engine(time.time())
    holder = {"host": "pod-a", "pid": 7, "engine": "policy", "op": "wake_up", "since": 1.0, "for_s": 2.5}
    lock = {"uuid": "GPU-sim-0", "held": True, "held_here": False, "holder": holder}
    state = {
        **engine,
        "engines": {"default": engine},
        "gpus": {"0": {"engines": ["default"], "awake": [], "used_bytes": 50 * GIB, "total_bytes": 80 * GIB}},
        "gpu_lock": {"dir": "/run/vllm-lifeguard/gpu-locks", "host": "pod-b", "gpus": {"0": lock}},
        "swap_queue": [],
    }
    server = await serve_page(aiohttp_server, lambda: (200, state))
    async with chromium(tmp_path / "profile", artifacts / "chromium-node-lock.log") as page:
        await page.navigate(str(server.make_url("/lifeguard/ui")))
        await page.wait_for("Number(document.body.dataset.refreshes) >= 1", "a first refresh")
        label = "[...document.querySelectorAll('[data-gpu=\"0\"] [data-lock]')].map(l => l.textContent)"
        assert await page.evaluate(label) == ["lock held by policy (wake_up) on pod-a"]
        assert page.problems == []


async def test_the_page_reads_the_one_front_shape_shows_hostile_text_as_text_and_says_when_it_cannot_read(
    aiohttp_server: Any, tmp_path: Path, artifacts: Path
) -> None:
    """After the one-front rewrite a single engine is under "engines" too, its own fields beside it; vLLM's
    error text (here markup) must stay text; a state that fails to load is said; a lost session stops the polling."""
    import time

    answers: list[tuple[int, Any]] = []
    served: list[int] = []

    def state() -> tuple[int, Any]:
        status, body = answers[0] if len(answers) == 1 else answers.pop(0)
        served.append(status)
        flat = flat_engine(time.time())
        if body == "one-front":
            body = {**flat, "engines": {"default": flat}}  # one engine: its own fields at the top, "gpus" a list
        return status, body

    server = await serve_page(aiohttp_server, state)
    answers.append((200, "one-front"))
    async with chromium(tmp_path / "profile", artifacts / "chromium-shapes.log") as page_:
        await page_.navigate(str(server.make_url("/lifeguard/ui")))
        await page_.wait_for("Number(document.body.dataset.refreshes) >= 1", "a first refresh")
        assert await page_.evaluate(
            "[...document.querySelectorAll('.engine[data-engine]')].map(e => e.dataset.engine)"
        ) == ["default"]
        assert await page_.evaluate(state_text("default")) == "RUNNING"
        assert await page_.evaluate("document.querySelector('[data-count=\"inflight\"] b').textContent") == "4"
        tags = await page_.evaluate("[...document.querySelectorAll('.tag')].map(t => t.textContent)")
        assert tags == ["weights stale: restarted"]
        error = await page_.evaluate("document.querySelector('#errors [data-error]').textContent")
        assert HOSTILE in error and "×2" in error
        assert await page_.evaluate("document.querySelectorAll('main img, main script').length") == 0
        assert await page_.evaluate("window.pwned === undefined")
        assert await page_.evaluate('document.querySelector(\'[data-gpu="0"] [data-segment="default"]\') !== null')
        drawn = await page_.evaluate(transitions("default"))
        assert drawn == ["FAILED>RUNNING"]

        answers[:] = [(503, {"error": {"message": "down"}})]
        await page_.wait_for(
            "document.getElementById('conn').textContent.includes('answered 503')", "a failed refresh said"
        )
        assert await page_.evaluate(state_text("default")) == "RUNNING"  # the last reading stays on screen

        answers[:] = [(401, {"error": {"message": "no"}})]
        await page_.wait_for("document.getElementById('conn').textContent.startsWith('signed out')", "signed out")
        polled = len(served)
        answers[:] = [(200, "one-front")]
        await asyncio.sleep(2.5)  # the absence of polling is the point: 2 refresh periods and a half
        assert len(served) == polled, "the page kept polling with a session that ended"
        assert [p for p in page_.problems if "status of 503" not in p and "status of 401" not in p] == []
