"""A proxy killed -9 in the middle of each lifecycle call and session phase, and a new one started beside the same
vLLM, with and without a state file (issue 49; the table in docs/reliability.md, "A restart anywhere", one row per
test here). After the restart the new proxy must never settle a state vLLM's flags contradict, and never release
inference onto weights it cannot vouch for; the trainer's next calls then bring the engine back.

The kill: the state file is left exactly as it was at that moment (kill -9 writes nothing more), every connection
of the old proxy is cut, and vLLM's call runs on (vLLM does not stop a call whose client went away). The call is
held inside the simulator until the kill, and then either ends before the new proxy looks ("before") or only after
the new proxy has adopted what it saw ("after": a call slowed inside vLLM, landing behind the new proxy's back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from lifeguard_sim.app import SimSettings
from tests.chaos.chaos_checks import engine_matches
from tests.e2e.conftest import FAST_SIM, Stack

RELOAD = {"method": "reload_weights"}
UPDATE = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
#: Long enough for any settle here; every wait below has its own, shorter than the test's.
DEADLINE_S = 8.0


@dataclass
class Cut:
    """One call held inside the simulator (`method` of its engine) until `release`; `done` once vLLM finished it."""

    method: str
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future[Any] | None = None


def hold_inside_vllm(stack: Stack, method: str) -> Cut:
    """The next call of the simulator's `method` waits inside vLLM for `cut.release`; later calls do not."""
    engine = stack.sim
    original = getattr(engine, method)
    cut = Cut(method)

    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            await asyncio.wait_for(cut.release.wait(), DEADLINE_S)
            return await original(*args, **kwargs)
        finally:
            cut.done.set()

    async def held(*args: Any, **kwargs: Any) -> Any:
        setattr(engine, method, original)
        cut.entered.set()
        # vLLM's lifecycle routes are not cancelled when their client goes away (no `with_cancellation`, which only
        # its generation routes have), and the engine core runs a utility call it was sent: the call runs on.
        cut.task = asyncio.ensure_future(run(*args, **kwargs))
        return await asyncio.shield(cut.task)

    setattr(engine, method, held)
    return cut


async def _within(event: asyncio.Event, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), DEADLINE_S)
    except TimeoutError:
        raise AssertionError(f"{what} within {DEADLINE_S} s") from None


async def _state(client: TestClient[Any, Any]) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get("/lifeguard/state")).json()
    return body


async def _settled(client: TestClient[Any, Any], stack: Stack, *, session_unknowable: bool = False) -> dict[str, Any]:
    """The new proxy's state once it agrees with vLLM's true state with no call in flight; fails naming the
    disagreement if it never does (a state vLLM's flags contradict)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = await _state(client)
        problem = "a lifecycle call is in flight" if state["lifecycle_busy"] else "still STARTING"
        if state["state"] != "STARTING" and not state["lifecycle_busy"]:
            problem = engine_matches(state, stack.sim.state_dict(), session_unknowable=session_unknowable)
            if problem is None:
                return state
        assert time.monotonic() < deadline, f"the restarted proxy never agreed with vLLM: {problem}; {state}"
        await asyncio.sleep(0.02)


async def kill_9(stack: Stack, call: asyncio.Future[Any]) -> None:
    """What `kill -9` of the proxy leaves: its state file as it is now, its connections (the client's and vLLM's)
    cut; the call it was running gets no answer, and vLLM's side of it runs on."""
    path = Path(stack.settings.state_file) if stack.settings.state_file else None
    left = path.read_bytes() if path is not None and path.exists() else None
    await stack.client.close()
    if path is not None:  # whatever the shutdown wrote is not what a killed process leaves
        if left is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(left)
    try:
        answer = await asyncio.wait_for(call, DEADLINE_S)
    except Exception:  # noqa: BLE001 - the connection error a killed proxy's client gets
        return
    raise AssertionError(f"the call the kill cut was answered: {answer.status} {await answer.text()}")


@dataclass
class Restart:
    """One row: a call cut by a kill -9 of the proxy, and the new proxy beside the same vLLM."""

    stack: Stack
    serve: Callable[..., Awaitable[TestClient[Any, Any]]]
    client: TestClient[Any, Any] | None = None

    async def cut(self, method: str, op: str, *, landed: str, params: dict[str, str] | None = None,
                  body: Any = None) -> TestClient[Any, Any]:  # fmt: skip
        """`op` sent through the proxy and held in vLLM's `method`; the proxy killed; the call ending in vLLM
        before the new proxy starts (`landed="before"`) or after it adopted what it saw (`"after"`)."""
        stack = self.stack
        held = hold_inside_vllm(stack, method)
        call = asyncio.ensure_future(stack.client.post(f"/{op}", params=params or {}, json=body))
        await _within(held.entered, f"/{op} reached vLLM")
        await kill_9(stack, call)
        if landed == "before":
            held.release.set()
            await _within(held.done, f"vLLM ended /{op}")
        client: TestClient[Any, Any] = await self.serve(stack.settings)
        self.client = client
        # Its first round over (what it adopted, its canary and its prefix-cache reset): a call landing in vLLM from
        # here on lands behind its back. (One landing during the canary would pause it in transit, as in the chaos
        # run's `in_transit`, which no proxy can see coming.)
        deadline = time.monotonic() + DEADLINE_S
        while (state := await _state(client))["state"] == "STARTING" or state["lifecycle_busy"]:
            assert time.monotonic() < deadline, f"the new proxy never adopted the engine: {state}"
            await asyncio.sleep(0.02)
        if landed == "after":
            held.release.set()
            await _within(held.done, f"vLLM ended /{op}")
        return client

    def completion(self, prompt: str = "hello") -> asyncio.Future[Any]:
        assert self.client is not None
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return asyncio.ensure_future(self.client.post("/v1/completions", json=body))

    async def held(self, prompt: str = "hello") -> asyncio.Future[Any]:
        """A completion the new proxy holds (it cannot vouch for the weights, or the engine is not serving)."""
        assert self.client is not None
        request = self.completion(prompt)
        deadline = time.monotonic() + DEADLINE_S
        while (await _state(self.client))["held_requests"] < 1:
            assert not request.done(), f"forwarded, not held: {(await request).status}"
            assert time.monotonic() < deadline, "the completion was not held"
            await asyncio.sleep(0.01)
        return request

    async def post(self, op: str, params: dict[str, str] | None = None, body: Any = None) -> tuple[int, str | None]:
        assert self.client is not None
        resp = await self.client.post(f"/{op}", params=params or {}, json=body)
        await resp.read()
        return resp.status, resp.headers.get("X-Lifeguard-Reason")

    async def held_until_a_reload(self, stale: str) -> None:
        """The new proxy settles RUNNING with the weights `stale` (why it cannot vouch for them), holds a completion,
        and answers it once the trainer's reload loaded the weights again."""
        assert self.client is not None
        state = await _settled(self.client, self.stack)
        assert state["state"] == "RUNNING" and state["weights_stale_reason"] == stale, state
        request = await self.held()
        assert (await self.post("collective_rpc", body=RELOAD))[0] == 200
        await self.served(request)

    async def served(self, request: asyncio.Future[Any] | None = None) -> None:
        """The held completion (or a new one) answered 200, and nothing ran where it must not have."""
        resp = await asyncio.wait_for(request or self.completion(), DEADLINE_S)
        assert resp.status == 200, await resp.text()
        assert self.stack.sim.violations == []


#: Every case of a row: with or without a state file, and the call ending in vLLM before or after the new proxy looked.
EVERY = [("file", "before"), ("file", "after"), ("no-file", "before"), ("no-file", "after")]
MakeRestart = Callable[..., Awaitable[Restart]]


@pytest.fixture
def make_restart(make_stack: Any, serve_lifeguard: Any, tmp_path: Path) -> MakeRestart:
    async def make(kept: str, sim: SimSettings | None = None) -> Restart:
        state_file = str(tmp_path / "lifeguard-state.json") if kept == "file" else None
        stack = await make_stack(sim=sim, state_file=state_file, shutdown_grace_s=0, weight_checksums="always")
        return Restart(stack, serve_lifeguard)

    return make


def _file(restart: Restart) -> bool:
    return restart.stack.settings.state_file is not None


def cases(*which: tuple[str, str]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("kept", "landed"), which or EVERY, ids=[f"{k}-{w}" for k, w in which or EVERY])


# ----- sleep, wake, pause, resume, release the KV cache
@cases()
@pytest.mark.parametrize("level", ["1", "2"])
async def test_sleep(make_restart: MakeRestart, kept: str, landed: str, level: str) -> None:
    """SLEEPING at the level vLLM's gauge says (a level-2 sleep: weights discarded, from the gauge or the file's
    write-ahead); inference held; the wake (and after level 2 a reload) releases it."""
    restart = await make_restart(kept)
    client = await restart.cut("sleep", "sleep", landed=landed, params={"level": level})
    state = await _settled(client, restart.stack)
    assert state["state"] == "SLEEPING" and state["sleep_level"] == int(level), state
    request = await restart.held()
    assert (await restart.post("wake_up"))[0] == 200
    if level == "2":  # discarded: held after the wake until the weights are loaded again
        assert (await _settled(client, restart.stack))["weights_stale_reason"] == "discarded"
        assert not request.done()
        assert (await restart.post("collective_rpc", body=RELOAD))[0] == 200
    await restart.served(request)


@cases()
async def test_wake_up_from_level_1(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """RUNNING on the weights the level-1 sleep offloaded; with the file, checked by the checksums taken before the
    sleep (the next row)."""
    restart = await make_restart(kept)
    assert (await restart.stack.client.post("/sleep", params={"level": "1"})).status == 200
    client = await restart.cut("wake_up", "wake_up", landed=landed)
    state = await _settled(client, restart.stack)
    assert state["state"] == "RUNNING" and not state["weights_stale"], state
    await restart.served()


@cases(("file", "before"), ("file", "after"))
async def test_wake_up_that_restored_other_weights(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """A level-1 wake that restored other bytes (lie-weights), which no proxy verified: the new proxy compares the
    weights' checksums with the digest the last proxy kept in the file before the sleep, and holds inference (the
    weights' "mismatch") until a reload. Without the file those checksums died with the killed proxy."""
    restart = await make_restart(kept)
    assert (await restart.stack.client.post("/sleep", params={"level": "1"})).status == 200
    restart.stack.faults("wake_up:lie-weights")
    await restart.cut("wake_up", "wake_up", landed=landed)
    await restart.held_until_a_reload("mismatch")


@cases(("file", "before"), ("file", "after"), ("no-file", "after"))
async def test_wake_up_from_level_2(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """RUNNING with the weights discarded (the file's, or the gauge's while vLLM still slept): held until a reload.
    Not with no file and the wake already done: an awake vLLM does not show a level-2 sleep (docs/behaviour.md)."""
    restart = await make_restart(kept)
    assert (await restart.stack.client.post("/sleep", params={"level": "2"})).status == 200
    await restart.cut("wake_up", "wake_up", landed=landed)
    await restart.held_until_a_reload("discarded")


@cases()
@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_pause(make_restart: MakeRestart, kept: str, landed: str, mode: str) -> None:
    """PAUSED (vLLM's flags, or drift the reconcile loop adopts once the pause lands); held until /resume."""
    restart = await make_restart(kept)
    client = await restart.cut("pause", "pause", landed=landed, params={"mode": mode})
    assert (await _settled(client, restart.stack))["state"] == "PAUSED"
    request = await restart.held()
    assert (await restart.post("resume"))[0] == 200
    await restart.served(request)


@cases()
async def test_resume(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """RUNNING once vLLM resumed (the file's pause is dropped: vLLM's flags say it is lifted)."""
    restart = await make_restart(kept)
    assert (await restart.stack.client.post("/pause", params={"mode": "keep"})).status == 200
    client = await restart.cut("resume", "resume", landed=landed)
    assert (await _settled(client, restart.stack))["state"] == "RUNNING"
    await restart.served()


@cases()
async def test_release_kv_cache_memory(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """SLEEPING: vLLM's flags say asleep and paused, its gauge "asleep at level 0", which a released KV cache and a
    level-0 sleep both read as (the new proxy cannot tell them apart, and takes a level-0 sleep: inference held, no
    second release, a wake brings back everything). The wake brings the KV cache back and the pause stays."""
    restart = await make_restart(kept)
    stack = restart.stack
    assert (await stack.client.post("/pause", params={"mode": "keep"})).status == 200
    client = await restart.cut("release_kv_cache_memory", "release_kv_cache_memory", landed=landed)
    deadline = time.monotonic() + DEADLINE_S
    while (state := await _state(client))["state"] != "SLEEPING" or stack.sim.asleep_tags != {"kv_cache"}:
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.02)
    assert state["asleep_tags"] in (["kv_cache"], ["scheduling"]), state
    assert await restart.post("release_kv_cache_memory") == (409, "already_asleep")
    request = await restart.held()
    assert (await restart.post("wake_up"))[0] == 200
    # The user's pause outlives the wake (vLLM's own wake lifts it) where the new proxy knew of it: from the file,
    # or from vLLM's flags before the release landed.
    after_wake = (await _settled(client, stack))["state"]
    assert after_wake == "PAUSED" or (not _file(restart) and landed == "before" and after_wake == "RUNNING")
    if after_wake == "PAUSED":
        assert (await restart.post("resume"))[0] == 200
    await restart.served(request)


@cases(("file", "after"), ("no-file", "after"))
async def test_pause_that_lands_inside_the_next_session(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """The adoption chaos seed 42 reverted: a /pause the killed proxy sent lands while the new proxy holds a
    weight-update session it opened from RUNNING. The finish reads vLLM's flags (PAUSED) instead of returning to the
    RUNNING the session started from, which forwarded held requests into the paused engine."""
    restart = await make_restart(kept)
    stack = restart.stack
    held = hold_inside_vllm(stack, "pause")
    call = asyncio.ensure_future(stack.client.post("/pause", params={"mode": "keep"}))
    await _within(held.entered, "/pause reached vLLM")
    await kill_9(stack, call)
    client = await restart.serve(stack.settings)
    restart.client = client
    assert (await _settled(client, stack))["state"] == "RUNNING"  # vLLM has not paused yet
    assert (await restart.post("start_weight_update", body={}))[0] == 200
    held.release.set()
    await _within(held.done, "vLLM ended /pause")
    request = await restart.held()
    assert (await restart.post("update_weights", body=UPDATE))[0] == 200
    assert (await restart.post("finish_weight_update", body={}))[0] == 200
    state = await _state(client)
    assert state["state"] == "PAUSED" and state["held_requests"] == 1, state
    assert stack.sim.violations == []
    assert (await restart.post("resume"))[0] == 200
    await restart.served(request)


# ----- a weight-update session, phase by phase
@cases()
async def test_start_weight_update(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """Chaos seed 42: the session the killed proxy's start opened in vLLM. With the file (written ahead of the
    start) the new proxy holds it: UPDATING_WEIGHTS, inference held. Without, it learns of it from vLLM's refusal of
    the trainer's next start (409 weight_update_active, and it holds the session). Either way the trainer's finish
    reaches vLLM, and its next session runs."""
    restart = await make_restart(kept)
    client = await restart.cut("start_weight_update", "start_weight_update", landed=landed, body={})
    state = await _settled(client, restart.stack, session_unknowable=not _file(restart))
    if _file(restart):
        assert state["state"] == "UPDATING_WEIGHTS" and state["weight_update_active"], state
        await restart.held()
    assert await restart.post("start_weight_update", body={}) == (409, "weight_update_active")
    assert (await _state(client))["weight_update_active"] is True
    assert (await restart.post("finish_weight_update", body={}))[0] == 200
    for op, body in (("start_weight_update", {}), ("update_weights", UPDATE), ("finish_weight_update", {})):
        assert (await restart.post(op, body=body))[0] == 200, op
    state = await _settled(client, restart.stack)
    assert state["state"] == "RUNNING" and not state["weights_stale"], state
    await restart.served()


@cases()
async def test_update_weights_in_a_session(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """With the file: UPDATING_WEIGHTS, the trainer's next chunk goes into the session, its finish releases
    inference. Without: vLLM's 200 to that chunk tells the new proxy of the session (held from then on)."""
    restart = await make_restart(kept)
    assert (await restart.stack.client.post("/start_weight_update", json={})).status == 200
    client = await restart.cut("update_weights", "update_weights", landed=landed, body=UPDATE)
    state = await _settled(client, restart.stack, session_unknowable=not _file(restart))
    request = None
    if _file(restart):
        assert state["state"] == "UPDATING_WEIGHTS", state
        request = await restart.held()
    assert (await restart.post("update_weights", body=UPDATE))[0] == 200  # the trainer sends the chunk again
    assert (await _state(client))["weight_update_active"] is True
    assert (await restart.post("finish_weight_update", body={}))[0] == 200
    state = await _settled(client, restart.stack)
    assert state["state"] == "RUNNING" and not state["weights_stale"], state
    await restart.served(request)


@cases()
async def test_finish_weight_update(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """The finish took in vLLM, and no flag says so. With the file the new proxy holds the session (inference held)
    until the trainer's finish again, which vLLM refuses: 409 weight_update_session_lost, the weights counted as
    changed. Either way no prefix-cache block of the old weights serves a request after it (the new proxy salts
    requests until its first reset)."""
    restart = await make_restart(kept)
    stack = restart.stack
    assert (await stack.completion("the prefix of the old weights")).status == 200  # blocks in the prefix cache
    for op, body in (("/start_weight_update", {}), ("/update_weights", UPDATE)):
        assert (await stack.client.post(op, json=body)).status == 200, op
    client = await restart.cut("finish_weight_update", "finish_weight_update", landed=landed, body={})
    state = await _settled(client, stack, session_unknowable=True)  # the session closed in vLLM: no flag says so
    if _file(restart):
        assert state["state"] == "UPDATING_WEIGHTS", state
        request = await restart.held("the prefix of the old weights")
        assert await restart.post("finish_weight_update", body={}) == (409, "weight_update_session_lost")
        await restart.served(request)
    else:
        assert await restart.post("finish_weight_update", body={}) == (409, "no_weight_update_session")
        await restart.served(restart.completion("the prefix of the old weights"))
    assert (await _settled(client, stack))["weight_update_active"] is False


# ----- reloads, resets, adapters
@cases(("file", "before"), ("file", "after"), ("no-file", "before"))
async def test_reload_weights(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """The reload after a level-2 sleep and wake. With the file the weights stay "discarded" (held) until the
    trainer's reload again, checked against the checkpoint's checksums; without one, vLLM awake on reloaded weights
    is all there is to see. (No file and a reload still to land: the level-2 row's limit, docs/behaviour.md.)"""
    restart = await make_restart(kept)
    for path, params in (("/sleep", {"level": "2"}), ("/wake_up", {})):
        assert (await restart.stack.client.post(path, params=params)).status == 200
    client = await restart.cut("collective_rpc", "collective_rpc", landed=landed, body=RELOAD)
    if _file(restart):
        await restart.held_until_a_reload("discarded")
    else:
        assert (await _settled(client, restart.stack))["weights_stale"] is False
        await restart.served()


@cases(("file", "before"), ("file", "after"))
async def test_weight_checker_reset(make_restart: MakeRestart, kept: str, landed: str) -> None:
    """`/weight_checker {"action": "reset"}` zeroes every weight: marked in the file before it is sent, so the new
    proxy holds inference until a reload. Without the file nothing shows zeroed weights (as after any restart)."""
    restart = await make_restart(kept)
    await restart.cut("collective_rpc", "weight_checker", landed=landed, body={"action": "reset"})
    await restart.held_until_a_reload("reset")


@cases()
async def test_load_lora_adapter(make_restart: MakeRestart, kept: str, landed: str, tmp_path: Path) -> None:
    """A LoRA adapter loaded (in place) while the proxy died: nothing of the lifecycle changes, the new proxy reads
    the adapter from vLLM, and it answers as itself."""
    restart = await make_restart(kept, SimSettings(**{**FAST_SIM.__dict__, "enable_lora": True}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    load = {"lora_name": "tuned", "lora_path": str(adapter)}
    assert (await restart.stack.client.post("/v1/load_lora_adapter", json=load)).status == 200
    client = await restart.cut("load_lora_adapter", "v1/load_lora_adapter", landed=landed,
                               body={**load, "load_inplace": True})  # fmt: skip
    assert (await _settled(client, restart.stack))["state"] == "RUNNING"
    body = {"model": "tuned", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status == 200 and (await answer.json())["model"] == "tuned"
    base = await client.post("/v1/completions", json={**body, "model": "tiny"})
    assert (await base.json())["choices"][0]["text"] != (await answer.json())["choices"][0]["text"]
    assert restart.stack.sim.violations == []
