"""A weight-update session vLLM holds that this proxy did not open: a proxy killed -9 between a trainer's
`/start_weight_update` and its finish leaves one, and the trainer's next `/update_weights` reaches the new proxy
(chaos seed 42, docs/reliability.md). vLLM's own route writes only inside a session, so its 200 is that session."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from .conftest import Stack

UPDATE = {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}


async def test_an_update_in_a_session_vllm_holds_is_adopted_and_releases_nothing_until_its_finish(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack()
    for call in ("/sleep?level=2", "/wake_up"):
        assert (await stack.client.post(call)).status == 200, call
    assert (await stack.state())["weights_stale_reason"] == "discarded"
    # The session a killed proxy opened, straight at vLLM.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as direct:
        started = await direct.post(str(stack.sim_server.make_url("/start_weight_update")), json={})
        assert started.status == 200, await started.text()
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)

    update = await stack.client.post("/update_weights", json=UPDATE)
    assert update.status == 200, await update.text()
    state = await stack.state()
    assert (state["state"], state["weight_update_active"], state["weights_stale_reason"]) == (
        "UPDATING_WEIGHTS",
        True,
        "discarded",
    ), state
    assert state["held_requests"] == 1 and not held.done()  # nothing runs on weights half written

    assert (await stack.client.post("/finish_weight_update", json={})).status == 200
    assert (await asyncio.wait_for(held, 10)).status == 200
    state = await stack.state()
    assert (state["state"], state["weights_stale"]) == ("RUNNING", False)
    assert stack.sim.violations == []
