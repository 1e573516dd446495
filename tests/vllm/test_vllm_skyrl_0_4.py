"""SkyRL 0.4.0's own code through the proxy in front of a real vLLM-for-CPU 0.32: its colocated and its
non-colocated weight-sync flows, as far as vLLM for CPU serves them.

`WorkerDispatch.save_weights_for_sampler`, the worker's `_sync_weights_to_inference_engines` and
`RemoteInferenceClient` run unmodified (tests/clients/skyrl_trainer.py). What vLLM for CPU cannot do is the
weight push itself (no CUDA IPC or NCCL, no weight-transfer engine: `/start_weight_update` answers
"Weight transfer not configured"), so the trainer engine's `send_weights` reloads the checkpoint with vLLM's
own `POST /collective_rpc {"method": "reload_weights"}` in its place: the weights come back for real (after
the level-2 sleep the proxy holds rollouts until they do). Sent, like SkyRL's blocking weight-sync client,
with `Connection: close`. The flows that need SkyRL's worker extension or server wrapper (the offload RPCs,
`/fetch_weights`) have no real counterpart here and run against the simulator only (tests/clients).

SkyRL 0.4.0 needs Python >= 3.12: scripts/test-vllm.sh runs this file in the SkyRL 0.4.0 venv
(`.venv-skyrl04`), after the rest of tests/vllm.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from importlib.metadata import PathDistribution
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients import stand_ins
from tests.vllm.vllm_e2e import (
    engine_never_saw_it,
    lg_state,
    skyrl_client,
    skyrl_rollout,
    vllm_flags,
    wait_held,
    wait_state,
    wait_until,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:client.loop property is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="session")
def site() -> Path:
    path = os.environ.get(stand_ins.SITE_ENV, "")
    if sys.version_info < (3, 12) or not path or not Path(path).is_dir():
        pytest.skip("SkyRL 0.4.0 needs Python >= 3.12 and its client site: scripts/test-vllm.sh runs this file")
    found = stand_ins.client_site()
    version = PathDistribution(next(found.glob("skyrl-*.dist-info"))).version
    assert version == "0.4.0", version
    return found


@pytest.fixture
def side(site: Path) -> Any:
    with stand_ins.modules_restored():
        from tests.clients.skyrl_trainer import skyrl_trainer_side

        yield skyrl_trainer_side(site)


class ReloadFromCheckpoint:
    """In place of the trainer engine's `send_weights` (CUDA IPC or NCCL, not on CPU): vLLM reloads its
    checkpoint. A `SkyrlTrainerCapabilities` engine like SkyRL's (the worker reads its flags)."""

    skyrl_handles_prefix_cache_reset = False
    skyrl_force_disable_expandable_segments = False
    skyrl_empty_cache_after_send = True

    def __init__(self, url: str, *, go: threading.Event | None = None) -> None:
        """`go`: the push waits for it (at most 60 s), so that a test sees the engine paused for as long as it
        needs; a tiny model's reload takes milliseconds."""
        self.url = url
        self.sent = 0
        self._go = go

    def send_weights(self) -> None:
        import requests

        if self._go is not None:
            assert self._go.wait(60), "the test never let the weight push go"
        response = requests.post(
            f"{self.url}/collective_rpc", json={"method": "reload_weights"}, headers={"Connection": "close"}, timeout=60
        )
        assert response.status_code == 200, (response.status_code, response.text)
        self.sent += 1


def driver(
    side: Any, skyrl: Any, url: str, *, colocate_all: bool, go: threading.Event | None = None
) -> tuple[Any, Any, ReloadFromCheckpoint]:
    from tests.clients.skyrl_trainer import PolicyActorGroup, config

    def client() -> Any:
        return skyrl_client(skyrl, url)

    cfg = config(colocate_all=colocate_all, backend="nccl")
    engine = ReloadFromCheckpoint(url, go=go)
    engine_client = client()
    dispatch = side.worker_dispatch(
        cfg, PolicyActorGroup(side, cfg, engine, client), inference_engine_client=engine_client
    )
    dispatch.mark_all_offloaded()
    return dispatch, engine_client, engine


async def in_trainer(session: aiohttp.ClientSession, url: str, flow: Any, timeout: float = 120) -> Any:
    try:
        return await asyncio.wait_for(asyncio.to_thread(asyncio.run, flow), timeout)
    except TimeoutError:
        raise AssertionError(f"SkyRL's sync did not end in {timeout:g} s: {await lg_state(session, url)}") from None


async def test_skyrl_0_4_colocated_step_is_sleeping_sleep_wake_reload_wake(
    side: Any, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    skyrl = stand_ins.skyrl_remote_inference_client(stand_ins.client_site())
    dispatch, engine_client, engine = driver(side, skyrl, proxy.url, colocate_all=True)

    async def step() -> tuple[dict[str, Any], dict[str, Any]]:
        async with engine_client:
            before = await skyrl_rollout(engine_client)
            await dispatch.save_weights_for_sampler()  # /is_sleeping: no -> /sleep?level=2 -> wakes around the reload
            return before, await skyrl_rollout(engine_client)

    before, after = await in_trainer(session, proxy.url, step())
    assert after["response_ids"] == before["response_ids"], "the checkpoint reloaded: the same greedy answer"
    assert engine.sent == 1
    state = await wait_state(session, proxy.url, "RUNNING")
    assert (state["asleep_tags"], state["weights_stale"], state["held_requests"]) == ([], False, 0), state
    assert state["last_verification"]["checks"][-1]["name"] == "canary", state["last_verification"]


async def test_skyrl_0_4_colocated_rollout_sent_while_asleep_waits_for_the_reload_and_the_kv_cache(
    side: Any, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    skyrl = stand_ins.skyrl_remote_inference_client(stand_ins.client_site())
    async with skyrl_client(skyrl, proxy.url) as engine_client:
        assert await engine_client.is_sleeping() is False
        await engine_client.sleep()  # level 2: the weights are discarded
        assert await engine_client.is_sleeping() is True  # SkyRL's next sync skips its own sleep
        held = asyncio.ensure_future(skyrl_rollout(engine_client))
        try:
            await wait_held(session, proxy.url, 1)
            await engine_client.wake_up(tags=["weights"])
            await engine_client.wake_up(tags=["kv_cache"])
            state = await lg_state(session, proxy.url)
            # Awake, but the weights a level-2 sleep discarded are not back: the rollout stays held.
            assert (state["state"], state["weights_stale_reason"], state["held_requests"]) == (
                "RUNNING",
                "discarded",
                1,
            ), state
            await engine_never_saw_it(session, vllm_server.url)
            ReloadFromCheckpoint(proxy.url).send_weights()
            await asyncio.wait_for(held, 60)
        finally:
            if not held.done():
                held.cancel()
    assert (await vllm_flags(session, vllm_server.url))[:2] == (False, False)


async def test_skyrl_0_4_non_colocated_pause_reload_resume_freezes_and_holds_rollouts(
    side: Any, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    skyrl = stand_ins.skyrl_remote_inference_client(stand_ins.client_site())
    # The push waits until the late rollout is seen held: without that, the pause of a tiny model's reload
    # could end before the rollout was sent (CI rehearsal 2026-12-06: paused for 60 ms, failed twice).
    go = threading.Event()
    dispatch, engine_client, engine = driver(side, skyrl, proxy.url, colocate_all=False, go=go)
    async with skyrl_client(skyrl, proxy.url) as generator:
        # Frozen by the keep pause. Long enough to be seen running: the tiny model wrote 400 tokens between two
        # polls of vLLM's /load (CI rehearsal 2026-12-06), and the wait below timed out on a rollout already done.
        in_flight = asyncio.ensure_future(skyrl_rollout(generator, max_tokens=3000))

        async def step() -> None:
            async with engine_client:
                await dispatch.save_weights_for_sampler()  # /pause?mode=keep -> reload -> /resume

        # The long rollout runs in vLLM before the pause, so the pause freezes it.
        await wait_until(lambda: vllm_flags(session, vllm_server.url), lambda f: f[2] == 1, 30, what="it to run")
        trainer = asyncio.ensure_future(in_trainer(session, proxy.url, step()))
        await wait_state(session, proxy.url, "PAUSED")
        late = asyncio.ensure_future(skyrl_rollout(generator))
        try:
            await wait_held(session, proxy.url, 1)
        finally:
            go.set()
        await trainer
        await asyncio.wait_for(asyncio.gather(in_flight, late), 120)
    assert engine.sent == 1
    state = await wait_state(session, proxy.url, "RUNNING")
    assert state["held_requests"] == 0, state


async def test_skyrl_0_4_weight_sync_client_on_a_vllm_without_weight_transfer_gets_vllms_error(
    side: Any, proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    """SkyRL's blocking client (`Connection: close`) against vLLM for CPU, which has no weight-transfer engine:
    vLLM's own error comes back, for the drafter's session too, and the proxy believes no session open."""
    client = side.control_plane.SkyrlWeightSyncClient([proxy.url], 1)
    try:
        with pytest.raises(RuntimeError, match="Weight transfer not configured"):
            await asyncio.to_thread(client.start_weight_update)
        with client.draft_session(), pytest.raises(RuntimeError, match="Weight transfer not configured"):
            await asyncio.to_thread(client.start_weight_update)
    finally:
        client.close()
    state = await lg_state(session, proxy.url)
    assert (state["state"], state["weight_update_active"]) == ("RUNNING", False), state
