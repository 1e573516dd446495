"""Core bugs the chaos run found, each pinned deterministically: a strict xfail until the core is fixed,
then a plain regression test.

When an xfail starts passing, remove its marker and its entry in chaos_checks.KNOWN_BUGS, so the chaos run
counts it as a broken invariant again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.config import Settings
from tests.lifeguard_testing import LifeguardServer


async def _stack(aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path,
                 sim_app: web.Application | None = None,
                 reconcile_interval_s: float = 0.2) -> tuple[TestClient[Any, Any], Engine]:  # fmt: skip
    gpu = tmp_path / "gpu.json"
    app = sim_app or create_sim_app(SimSettings(sleep_seconds=0.01, wake_seconds=0.01, gpu_file=gpu))
    server = await aiohttp_server(app)
    settings = Settings(
        upstream=str(server.make_url("")).rstrip("/"),
        gpu_probe=f"file:{gpu}",
        reconcile_interval_s=reconcile_interval_s,
        verify_timeout_s=1.0,
        verify_poll_interval_s=0.01,
    )
    client: TestClient[Any, Any] = await aiohttp_client(LifeguardServer(settings))
    deadline = time.monotonic() + 5
    while (await (await client.get("/lifeguard/state")).json())["state"] != "RUNNING":
        assert time.monotonic() < deadline, "the proxy never reached RUNNING"
        await asyncio.sleep(0.01)
    return client, app[SIM_ENGINE]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="stale_noop (chaos_checks.KNOWN_BUGS): a no-op is answered from the proxy's belief, which an engine "
    "restart leaves stale until the next reconcile round (docs/reliability.md)",
)
async def test_a_repeated_sleep_after_the_engine_restarted_awake_is_not_answered_from_a_stale_belief(
    aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    """The chaos run's `stale_noop`: vLLM died and came back awake between two reconcile rounds; the proxy, still
    believing it asleep, answered the next /sleep as a no-op while the engine was awake. Wanted: the 200 of a
    /sleep means the engine sleeps at that level."""
    client, engine = await _stack(aiohttp_server, aiohttp_client, tmp_path, reconcile_interval_s=60)
    assert (await client.post("/sleep", params={"level": "1"})).status == 200
    engine.restart()  # a fresh process, awake, well before the next reconcile round
    resp = await client.post("/sleep", params={"level": "1"})
    assert resp.status == 200, await resp.text()
    assert engine.is_sleeping and engine.sleep_level == 1, resp.headers.get("X-Lifeguard-Noop")


async def test_reload_weights_is_refused_while_the_weights_sleep(aiohttp_server: Any, aiohttp_client: Any,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    client, engine = await _stack(aiohttp_server, aiohttp_client, tmp_path)
    assert (await client.post("/sleep", params={"level": "2"})).status == 200
    resp = await client.post("/collective_rpc", json={"method": "reload_weights"})
    assert engine.violations == []
    assert resp.status == 409
    assert resp.headers["X-Lifeguard-Reason"] == "weights_asleep"
    assert (await (await client.get("/lifeguard/state")).json())["weights_stale"] is True


async def test_an_update_queued_behind_the_start_of_a_session_is_forwarded_in_that_session(
    aiohttp_server: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    client, engine = await _stack(aiohttp_server, aiohttp_client, tmp_path)
    engine.set_faults(["start_weight_update:slow:0.3"])
    start = asyncio.ensure_future(client.post("/start_weight_update"))
    deadline = time.monotonic() + 5
    while engine.counters["start_weight_update"] == 0:  # the start is in flight, holding the lifecycle lock
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    update = await client.post("/update_weights", json={"update_info": {}})
    assert (await start).status == 200
    assert update.status == 200, await update.text()


async def test_a_wake_of_the_kv_cache_alone_that_did_nothing_is_caught(aiohttp_server: Any, aiohttp_client: Any,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    client, engine = await _stack(aiohttp_server, aiohttp_client, tmp_path)
    assert (await client.post("/sleep", params={"level": "1"})).status == 200
    engine.set_faults(["wake_up:lie-asleep"])
    resp = await client.post("/wake_up", params={"tags": "kv_cache"})
    assert resp.status == 503
    assert resp.headers["X-Lifeguard-Reason"] == "verification_failed"
    assert (await (await client.get("/lifeguard/state")).json())["asleep_tags"] == ["kv_cache", "weights"]
