"""Each trainer guide's request sequences, replayed through the proxy in front of the simulator.

The sequences are parsed from the ```http blocks of docs/guides/*.md, so a guide and its test cannot
drift apart. Two things stand in for what the simulator does not serve:
- `/inference/v1/generate` (the token-in/token-out route SkyRL, prime-rl and vime use; the simulator
  has only the OpenAI routes) is sent as the same request on `/v1/completions`. The proxy classifies
  both as inference (asserted below), so it treats them the same way.
- Routes that exist only on a trainer's own vLLM server wrapper or worker extension (SkyRL's
  `skyrl_*`/`update_weights_*` RPCs, prime-rl's `/init_broadcaster` and `/update_weights
  {"weight_dir"}`, AReaL's `/areal_*`) are emulated on the simulator by a middleware that does to the
  engine what that wrapper does (load weights, pause, resume), and records a violation when it would
  touch weights that are asleep.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.config import Settings
from proxy.front.route_table import RouteKind, build_table
from tests.lifeguard_testing import without_lifeguard_env

GUIDES = Path(__file__).resolve().parents[2] / "docs" / "guides"
HTTP_TRAINERS = ["skyrl", "trl", "prime-rl", "areal", "vime"]
BLOCK = re.compile(r"```http\n# sequence: (?P<name>[^\n]+)\n(?P<body>.*?)```", re.DOTALL)
LINE = re.compile(
    r"^(?P<concurrent>& )?(?P<method>GET|POST) (?P<target>\S+)(?: (?P<body>\{.*\}))?(?: -> (?P<status>\d{3}))?$"
)
MODEL = "tiny"
SKYRL_RPCS = {"skyrl_start_weight_update", "update_weights_ipc", "update_weights_nccl", "skyrl_finish_weight_update"}
PRIME_TOKEN = "prime-rl-api-key"


@dataclass(frozen=True)
class Step:
    method: str
    target: str
    body: Any
    status: int
    concurrent: bool

    def __str__(self) -> str:
        return f"{self.method} {self.target}"


@dataclass
class Sequence:
    name: str
    steps: list[Step] = field(default_factory=list)


def sequences(guide: str) -> list[Sequence]:
    """The ```http blocks of docs/guides/<guide>.md, in document order."""
    found = []
    for block in BLOCK.finditer((GUIDES / f"{guide}.md").read_text()):
        sequence = Sequence(block["name"].strip())
        for raw in block["body"].strip().splitlines():
            match = LINE.match(raw.strip())
            assert match, f"{guide}.md, sequence {sequence.name!r}: cannot parse {raw!r}"
            sequence.steps.append(
                Step(
                    method=match["method"],
                    target=match["target"],
                    body=json.loads(match["body"]) if match["body"] else None,
                    status=int(match["status"] or 200),
                    concurrent=bool(match["concurrent"]),
                )
            )
        found.append(sequence)
    return found


# --- what the trainers' own server wrappers add on top of vLLM, emulated on the simulator


def _trainer_server_routes(engine: Engine) -> Callable[..., Awaitable[web.StreamResponse]]:
    def weights_touched(what: str) -> None:
        if "weights" in engine.asleep_tags:
            engine.violate(f"{what}_while_weights_asleep", f"{what} while the weights are asleep")

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if path == "/collective_rpc":
            body = json.loads(await request.read())
            method = body.get("method")
            if method in SKYRL_RPCS:  # SkyRL's NewInferenceWorkerWrap
                engine.check_alive()
                weights_touched(method)
                if method == "skyrl_finish_weight_update":
                    engine.weights_valid = True
                    engine.garbage = False
                return web.Response(status=200)
        if path == "/init_broadcaster":  # prime-rl's server
            return web.json_response({"status": "ok"})
        if path == "/update_weights":
            body = json.loads(await request.read())
            if "weight_dir" in body:  # prime-rl's server: collective_rpc update_weights_from_path
                await engine.collective_rpc("reload_weights")
                return web.json_response({"status": "ok"})
        if path == "/areal_pause_generation":  # AReaL's server: native pause, abort + clear cache
            await engine.pause("abort")
            return web.json_response({"success": True})
        if path == "/areal_continue_generation":
            await engine.resume()
            return web.json_response({"success": True})
        return await handler(request)

    return middleware


# --- the stack: simulator, proxy in front of it


@dataclass
class Stack:
    proxy: TestClient
    engine: Engine
    headers: dict[str, str]

    async def send(self, step: Step) -> tuple[int, Any]:
        method, target, body = step.method, step.target, step.body
        if target == "/inference/v1/generate":
            target = "/v1/completions"
            body = {
                "model": body["model"],
                "prompt": body["token_ids"],
                "max_tokens": body["sampling_params"]["max_tokens"],
            }
        kwargs: dict[str, Any] = {"headers": self.headers}
        if body is not None:
            kwargs["data"] = json.dumps(body)
            kwargs["headers"] = {**self.headers, "Content-Type": "application/json"}
        async with self.proxy.request(method, target, **kwargs) as response:
            raw = await response.read()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = raw
            return response.status, parsed

    async def replay(self, sequence: Sequence) -> None:
        index = 0
        while index < len(sequence.steps):
            group = [sequence.steps[index]]
            while index + len(group) < len(sequence.steps) and sequence.steps[index + len(group)].concurrent:
                group.append(sequence.steps[index + len(group)])
            results = await asyncio.gather(*(self.send(step) for step in group))
            for step, (status, body) in zip(group, results, strict=True):
                assert status == step.status, f"{sequence.name}: {step} -> {status} {body}"
                if step.target.startswith(("/inference/v1/generate", "/v1/completions")):
                    assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
            index += len(group)

    async def state(self) -> dict[str, Any]:
        async with self.proxy.get("/lifeguard/state", headers=self.headers) as response:
            assert response.status == 200
            result: dict[str, Any] = await response.json()
            return result

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        for _ in range(400):
            current = await self.state()
            if predicate(current):
                return current
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}; state: {current}")

    async def complete(self, max_tokens: int = 8) -> tuple[int, Any]:
        body = {"model": MODEL, "prompt": [101, 2023, 2003], "max_tokens": max_tokens}
        return await self.send(Step("POST", "/v1/completions", body, 200, False))

    async def assert_healthy_end(self) -> None:
        status, body = await self.complete()
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        state = await self.wait_for(lambda s: s["state"] == "RUNNING", "RUNNING")
        assert state["held_requests"] == 0 and not state["weight_update_active"]
        assert self.engine.state_dict()["violations"] == []


@pytest.fixture(autouse=True)
def _no_lifeguard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    without_lifeguard_env(monkeypatch)


@pytest.fixture
async def make_stack(
    aiohttp_server: Any, serve_lifeguard: Any, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    async def make(headers: dict[str, str] | None = None, sim: dict[str, Any] | None = None, **overrides: Any) -> Stack:
        gpu_file = tmp_path / "gpu.json"
        sim_app = create_sim_app(SimSettings(model=MODEL, gpu_file=gpu_file, token_seconds=0.002, **(sim or {})))
        engine = sim_app[SIM_ENGINE]
        sim_app.middlewares.append(_trainer_server_routes(engine))
        sim: TestServer = await aiohttp_server(sim_app)
        # A short hold timeout turns a rollout held by mistake into a quick 503 instead of a hang.
        overrides.setdefault("hold_timeout_s", 10.0)
        settings = Settings(
            upstream=str(sim.make_url("")), gpu_probe=f"file:{gpu_file}", canary_enabled=False, **overrides
        )
        stack = Stack(await serve_lifeguard(settings), engine, headers or {})
        await stack.wait_for(lambda s: s["state"] == "RUNNING", "the proxy to see the engine")
        return stack

    yield make


TRAINER_SETUP: dict[str, dict[str, Any]] = {
    # SkyRL 0.4.0's server wrapper and worker extension are the simulator's own (trainer_servers), with a drafter.
    "skyrl": {
        "weight_reload_rpc_methods": ("reload_weights", "skyrl_finish_weight_update"),
        "sim": {"trainer_servers": ("skyrl",), "draft_model": True},
    },
    "prime-rl": {"admin_token": PRIME_TOKEN, "headers": {"Authorization": f"Bearer {PRIME_TOKEN}"}},
}


async def _stack_for(make_stack: Callable[..., Awaitable[Stack]], guide: str) -> Stack:
    setup = dict(TRAINER_SETUP.get(guide, {}))
    return await make_stack(headers=setup.pop("headers", None), sim=setup.pop("sim", None), **setup)


def test_every_http_trainer_guide_documents_its_config_key_and_sequences() -> None:
    for guide in HTTP_TRAINERS:
        text = (GUIDES / f"{guide}.md").read_text()
        assert "**Change" in text, f"{guide}.md: say which config key to change"
        assert "Caveats" in text, f"{guide}.md: list the caveats"
        assert sequences(guide), f"{guide}.md: no ```http sequence block"
    index = (GUIDES / "README.md").read_text()
    for guide in [*HTTP_TRAINERS, "in-process-trainers"]:
        assert f"({guide}.md)" in index


def test_the_generate_route_is_treated_like_completions() -> None:
    table = build_table()
    assert table.classify("POST", "/inference/v1/generate") is table.classify("POST", "/v1/completions")
    assert table.classify("POST", "/v1/completions") is RouteKind.INFERENCE


@pytest.mark.parametrize("guide", [g for g in HTTP_TRAINERS if g != "trl"] + ["trl"])
async def test_the_guide_sequences_run_cleanly_through_the_proxy(
    guide: str, make_stack: Callable[..., Awaitable[Stack]]
) -> None:
    """Every documented sequence, in document order, twice (a second training step must work too)."""
    stack = await _stack_for(make_stack, guide)
    documented = sequences(guide)
    startup = [s for s in documented if s.name == "startup"]
    for sequence in startup:
        await stack.replay(sequence)
    for _ in range(2):
        for sequence in documented:
            if sequence.name != "startup":
                await stack.replay(sequence)
                await stack.assert_healthy_end()


# --- behaviour the guides promise, beyond the plain sequence


def _steps(guide: str, name: str) -> list[Step]:
    return next(s for s in sequences(guide) if s.name == name).steps


async def test_trl_rollouts_in_flight_and_arriving_during_a_weight_sync_complete_after_resume(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _stack_for(make_stack, "trl")
    await stack.replay(next(s for s in sequences("trl") if s.name == "startup"))
    pause, *update, resume = _steps("trl", "weight sync")
    assert pause.target == "/pause?mode=keep" and resume.target == "/resume"

    in_flight = asyncio.ensure_future(stack.complete(max_tokens=200))
    for _ in range(400):
        if stack.engine.scheduler.running:
            break
        await asyncio.sleep(0.005)
    assert (await stack.send(pause))[0] == 200
    arriving = asyncio.ensure_future(stack.complete())
    await stack.wait_for(lambda s: s["held_requests"] == 1, "the new rollout to be held")
    for step in update:
        assert (await stack.send(step))[0] == 200, step
    assert not in_flight.done() and not arriving.done()
    assert (await stack.send(resume))[0] == 200
    for rollout in (in_flight, arriving):
        status, body = await rollout
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert len(in_flight.result()[1]["choices"][0]["text"]) > 0
    await stack.assert_healthy_end()


async def test_skyrl_colocated_needs_its_finish_rpc_registered_as_a_weight_reload(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """Without LIFEGUARD_WEIGHT_RELOAD_RPC_METHODS (the guide's setting) rollouts stay held after a
    level-2 sleep: the proxy never learns that SkyRL reloaded the weights."""
    stack = await make_stack(hold_timeout_s=0.5)
    *step, rollout = _steps("skyrl", "colocated step")
    for item in step:
        assert (await stack.send(item))[0] == 200, item
    status, body = await stack.send(rollout)
    assert status == 503, body
    assert (await stack.state())["weights_stale"] is True
    assert stack.engine.state_dict()["violations"] == []


async def test_prime_rl_admin_calls_need_its_bearer_token(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await _stack_for(make_stack, "prime-rl")
    pause = _steps("prime-rl", "checkpoint")[0]
    anonymous = Stack(stack.proxy, stack.engine, headers={})
    assert (await anonymous.send(pause))[0] == 401
    wrong = Stack(stack.proxy, stack.engine, headers={"Authorization": "Bearer nope"})
    assert (await wrong.send(pause))[0] == 403
    assert (await anonymous.complete())[0] == 200, "inference needs no admin token"
    assert not stack.engine.is_paused
    await stack.replay(next(s for s in sequences("prime-rl") if s.name == "checkpoint"))
    await stack.assert_healthy_end()


async def test_vime_over_sampling_abort_returns_in_flight_rollouts_as_200_abort(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _stack_for(make_stack, "vime")
    pause, resume = _steps("vime", "over-sampling abort")
    in_flight = asyncio.ensure_future(stack.complete(max_tokens=400))
    for _ in range(400):
        if stack.engine.scheduler.running:
            break
        await asyncio.sleep(0.005)
    assert (await stack.send(pause))[0] == 200
    status, body = await in_flight
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort", body
    assert (await stack.send(resume))[0] == 200
    await stack.assert_healthy_end()


async def test_areal_rollouts_sent_while_asleep_are_held_and_served_after_wake(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await _stack_for(make_stack, "areal")
    pause, sleep, wake, resume, rollout = _steps("areal", "colocated step")
    for step in (pause, sleep):
        assert (await stack.send(step))[0] == 200, step
    held = asyncio.ensure_future(stack.send(rollout))
    await stack.wait_for(lambda s: s["held_requests"] == 1, "the rollout to be held")
    assert stack.engine.counters["generate"] == 0
    for step in (wake, resume):
        assert (await stack.send(step))[0] == 200, step
    status, body = await held
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    await stack.assert_healthy_end()
