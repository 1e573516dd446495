"""Breaches of engine safety are recorded, and a careful caller records none."""

from __future__ import annotations

import asyncio

from tests.conformance.api import eventually
from tests.sim.conftest import Sim, SimFactory


def _kinds(sim: Sim) -> list[str]:
    return [str(v["kind"]) for v in sim.engine.violations]


async def _held(sim: Sim) -> bool:
    return await sim.api.server_load() >= 1


async def test_a_careful_lifecycle_records_no_violation(sim: Sim) -> None:
    await sim.api.completion()
    await sim.api.sleep(2)
    await sim.api.wake("weights")
    await sim.api.call("POST", "/collective_rpc", json_body={"method": "reload_weights"})
    await sim.api.wake("kv_cache")
    await sim.api.post("/pause")
    await sim.api.post("/start_weight_update")
    await sim.api.call("POST", "/update_weights", json_body={"update_info": {}})
    await sim.api.call("POST", "/finish_weight_update", json_body={"weight_version": "v1"})
    await sim.api.post("/resume")
    await sim.api.completion()
    assert (await sim.state())["violations"] == []


async def test_generation_reaching_a_sleeping_engine_is_recorded(sim: Sim) -> None:
    await sim.api.sleep(1)
    request = asyncio.create_task(sim.api.completion())
    await eventually(lambda: _held(sim))
    await sim.api.wake()
    await request
    assert _kinds(sim) == ["generate_while_asleep_or_paused"]


async def test_generation_reaching_a_paused_engine_is_recorded(sim: Sim) -> None:
    await sim.api.post("/pause", mode="keep")  # queued on every release
    request = asyncio.create_task(sim.api.completion())
    await eventually(lambda: _held(sim))
    await sim.api.post("/resume")
    await request
    assert _kinds(sim) == ["generate_while_asleep_or_paused"]


async def test_a_request_vllm_033_refuses_while_paused_is_still_recorded(make_sim: SimFactory) -> None:
    """It reached a paused engine (the proxy let it through) even though vLLM 0.33 refused it instead of queuing it."""
    sim = await make_sim(vllm_version="0.33")
    await sim.api.post("/pause", mode="abort")
    answer = await sim.api.completion()
    assert answer.status == 503
    assert _kinds(sim) == ["generate_while_asleep_or_paused"]


async def test_resume_while_asleep_is_recorded(sim: Sim) -> None:
    await sim.api.sleep(1)
    await sim.api.post("/resume")
    violation = (await sim.state())["violations"][0]
    assert violation["kind"] == "resume_while_asleep"
    assert {"kind", "detail", "at"} <= set(violation)


async def test_update_weights_while_weights_asleep_is_recorded(sim: Sim) -> None:
    await sim.api.post("/start_weight_update")
    await sim.api.sleep(1)
    await sim.api.call("POST", "/update_weights", json_body={"update_info": {}})
    assert _kinds(sim) == ["update_weights_while_asleep"]


async def test_generation_on_discarded_weights_is_recorded(sim: Sim) -> None:
    await sim.api.sleep(2)
    await sim.api.wake()
    await sim.api.completion()
    assert _kinds(sim) == ["generate_with_invalid_weights"]
    assert (await sim.state())["weights_valid"] is False


async def test_violations_survive_a_restart(sim: Sim) -> None:
    await sim.api.sleep(1)
    await sim.api.post("/resume")
    sim.engine.restart()
    state = await sim.state()
    assert [v["kind"] for v in state["violations"]] == ["resume_while_asleep"]
    assert state["counters"]["restart"] == 1
    assert (state["asleep_tags"], state["paused"], state["weight_version"]) == ([], False, "default")
