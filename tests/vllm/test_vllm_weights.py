"""Weight-update ordering through the proxy. vLLM-for-CPU has no weight transfer configured, so every
start/update/finish it receives fails with 500 "Weight transfer not configured"; the proxy must refuse
the out-of-order calls itself (409) and never believe a session is open after vLLM refused one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm.vllm_e2e import assert_proxy_error, lg_state, metrics, post, sleep_ops, vllm_flags, weight_ops

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


async def test_finish_without_a_session_is_409_not_vllms_500(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    before = weight_ops(await metrics(session, vllm_server.url), "finish")
    status, body, headers = await post(session, proxy.url + "/finish_weight_update", json={"weight_version": "v2"})
    assert_proxy_error(status, body, headers, 409)
    assert weight_ops(await metrics(session, vllm_server.url), "finish") == before  # never reached vLLM


async def test_start_while_weights_asleep_is_409_not_forwarded(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    before = weight_ops(await metrics(session, vllm_server.url), "start")
    status, body, headers = await post(session, proxy.url + "/start_weight_update")
    assert_proxy_error(status, body, headers, 409)
    assert weight_ops(await metrics(session, vllm_server.url), "start") == before
    assert (await lg_state(session, proxy.url))["state"] == "SLEEPING"


async def test_update_while_weights_asleep_is_409_not_forwarded(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    assert (await post(session, proxy.url + "/sleep?level=1"))[0] == 200
    before = weight_ops(await metrics(session, vllm_server.url), "update")
    status, body, headers = await post(session, proxy.url + "/update_weights", json={"update_info": {}})
    assert_proxy_error(status, body, headers, 409)
    assert weight_ops(await metrics(session, vllm_server.url), "update") == before


async def test_start_refused_by_vllm_leaves_no_session_open(
    proxy: Any, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    before = weight_ops(await metrics(session, vllm_server.url), "start")
    status, body, _ = await post(session, proxy.url + "/start_weight_update")
    assert weight_ops(await metrics(session, vllm_server.url), "start") == before + 1  # it was forwarded
    assert status >= 500 and status != 200, (status, body)
    assert "Weight transfer not configured" in str(body), body  # vLLM's message is passed on
    st = await lg_state(session, proxy.url)
    assert st["state"] == "RUNNING" and st["weight_update_active"] is False, st
    # and so a finish is still out of order
    status, body, headers = await post(session, proxy.url + "/finish_weight_update")
    assert_proxy_error(status, body, headers, 409)


async def test_weight_version_and_info_pass_through(proxy: Any, session: aiohttp.ClientSession) -> None:
    status, body, _ = await post(session, proxy.url + "/update_weight_version", json={"new_version": "v7"})
    assert (status, body) == (200, {"success": True, "new_version": "v7"})
    async with session.get(proxy.url + "/weight_info") as r:
        info = await r.json()
    # vLLM's shape with the vouched label (the relabel renamed the proxy's version too) and vLLM's own beside it
    assert (info["weight_version"], info["vllm_weight_version"], info["weights_partial"]) == ("v7", "v7", False)
    status, body, _ = await post(session, proxy.url + "/update_weight_version", json={})
    assert status == 400 and body["error"]["param"] == "body.new_version", body  # vLLM's own validation


async def test_a_proxy_restarted_inside_a_session_on_a_paused_vllm_refuses_sleep_and_resume(
    start_proxy: Any, vllm_server: Any, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """vLLM's own flags after `/pause?mode=keep`, read by a proxy restarted with a state file that keeps a weight
    update session (found by `make chaos-pods`, seeds 101 and 102, where the flags were the simulator's): it adopts
    UPDATING_WEIGHTS, not PAUSED, and a /sleep or /resume never reaches vLLM inside the session. vLLM-for-CPU has no
    weight-transfer engine to open a session, so the file is the one a proxy killed inside a session leaves."""
    state_file = tmp_path / "lifeguard-state.json"
    first = start_proxy(LIFEGUARD_STATE_FILE=str(state_file))
    assert (await post(session, first.url + "/pause?mode=keep"))[0] == 200
    first.stop()
    facts = json.loads(state_file.read_text())
    assert facts["user_pause"] == "keep", facts
    state_file.write_text(json.dumps({**facts, "weight_update_session": "model", "session_returns_to": "PAUSED"}))

    restarted = start_proxy(
        LIFEGUARD_STATE_FILE=str(state_file), reset=False, ready=lambda state: state.get("state") != "STARTING"
    )
    state = await lg_state(session, restarted.url)
    assert state["state"] == "UPDATING_WEIGHTS" and state["weight_update_active"] is True, state
    sleeps = sleep_ops(await metrics(session, vllm_server.url))
    for path in ("/sleep?level=2", "/resume", "/pause?mode=keep"):
        status, body, headers = await post(session, restarted.url + path)
        assert assert_proxy_error(status, body, headers, 409)["reason"] == "weight_update_in_progress", path
    assert sleep_ops(await metrics(session, vllm_server.url)) == sleeps, "a /sleep reached vLLM"
    assert (await vllm_flags(session, vllm_server.url))[1] is True, "a /resume reached vLLM"
