"""vLLM 0.34's fault tolerance (`--enable-fault-tolerance`): a faulted engine refuses requests while /health stays
200, holds lifecycle calls, and recovers through /v1/fault_tolerance/apply; the `engine-fault` fault faults it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lifeguard_sim.versions import ENGINE_DEAD_CLIENT_MESSAGE
from tests.conformance.api import StreamResult, eventually, still_pending
from tests.sim.conftest import Sim, SimFactory

FAULTED = {
    "error": {
        "message": "The engine has faulted and cannot accept new requests. Please try again later or on a different "
        "instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
}
FT = {"vllm_version": "0.34", "enable_fault_tolerance": True}


async def _apply(sim: Sim, body: Any, content_type: str = "application/json") -> Any:
    async with sim.api.session.post(
        sim.api.base + "/v1/fault_tolerance/apply", json=body, headers={"Content-Type": content_type}
    ) as resp:
        return resp.status, await resp.json()


async def _engines(sim: Sim) -> list[dict[str, Any]]:
    body = (await sim.api.get("/v1/fault_tolerance/status")).body
    assert (body["schema_version"], body["total_engines"]) == (1, 1)
    return list(body["engines"])


async def _fault(sim: Sim) -> StreamResult:
    sim.engine.set_faults(["generate:engine-fault"])
    result = await sim.api.stream_completion(StreamResult(), max_tokens=8)
    assert (result.finish_reason, result.done) == ("abort", True)  # on_fault aborts every request
    return result


async def test_a_faulted_engine_refuses_requests_503_while_health_is_200_until_a_retry(make_sim: SimFactory) -> None:
    sim = await make_sim(**FT)
    assert await _engines(sim) == [{"id": 0, "status": "healthy"}]
    await _fault(sim)
    assert await _engines(sim) == [{"id": 0, "status": "unhealthy", "fault_info": "RuntimeError"}]
    assert (await sim.api.get("/health")).status == 200
    refused = await sim.api.completion(max_tokens=4)
    assert (refused.status, refused.body) == (503, FAULTED)
    streamed = await sim.api.call("POST", "/v1/completions", json_body={"prompt": "x", "stream": True})
    assert (streamed.status, streamed.body) == (503, FAULTED)  # check_admission runs before a stream starts
    accepted = await _apply(sim, {"instruction": "retry", "params": {}, "request_id": "round-1"})
    assert accepted == (
        202,
        {"message": "Request accepted; poll /v1/fault_tolerance/status for updates.", "request_id": "round-1"},
    )
    assert await _engines(sim) == [{"id": 0, "status": "healthy"}]
    assert (await sim.api.completion(max_tokens=4)).status == 200


async def test_a_lifecycle_call_waits_for_the_recovery(make_sim: SimFactory) -> None:
    sim = await make_sim(**FT)
    await _fault(sim)
    sleep = asyncio.create_task(sim.api.sleep(1))
    assert await still_pending(sleep)  # the busy loop takes no utility call while it waits
    await _apply(sim, {"instruction": "retry", "request_id": "r"})
    assert (await asyncio.wait_for(sleep, 10)).status == 200


async def test_without_a_recovery_in_time_the_engine_dies(make_sim: SimFactory) -> None:
    sim = await make_sim(**FT, ft_recovery_seconds=0.2, watchdog_seconds=30)
    await _fault(sim)

    async def dead() -> bool:
        return (await sim.api.get("/health")).status == 503

    await eventually(dead, what="the engine to die after the recovery timeout")
    assert await _engines(sim) == [{"id": 0, "status": "dead"}]
    answer = await sim.api.completion(max_tokens=4)
    # _preflight checks the dead flag before check_admission (entrypoints/generate/base/serving.py)
    assert (answer.status, answer.body["error"]["message"]) == (500, ENGINE_DEAD_CLIENT_MESSAGE)


@pytest.mark.parametrize(
    ("request_body", "reason"),
    [
        ({"instruction": "retry", "request_id": "r"}, "[FT] Rejecting retry on engine 0: status is HEALTHY"),
        (
            {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}, "request_id": "r"},
            "[FT] Rejecting scale_down on engine 0: status is HEALTHY",
        ),
    ],
)
async def test_an_instruction_to_a_healthy_engine_is_accepted_then_fails(
    make_sim: SimFactory, request_body: dict[str, Any], reason: str
) -> None:
    sim = await make_sim(**FT)
    assert (await _apply(sim, request_body))[0] == 202
    assert await _engines(sim) == [
        {"id": 0, "status": "healthy", "ft_state": "failed", "last_ft_request_id": "r", "ft_error": reason}
    ]


async def test_scale_down_needs_ranks_to_remove(make_sim: SimFactory) -> None:
    sim = await make_sim(**FT)
    await _fault(sim)
    await _apply(sim, {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}, "request_id": "r"})
    [entry] = await _engines(sim)
    assert entry["ft_error"] == "scale_down requires data_parallel_size > 1; a dp=1 engine has no ranks to remove"
    assert entry["status"] == "unhealthy"
    wider = await make_sim(**FT, data_parallel_size=2)
    await _fault(wider)
    await _apply(wider, {"instruction": "scale_down", "params": {"removed_dp_ranks": [1]}, "request_id": "r2"})
    assert await _engines(wider) == [{"id": 0, "status": "healthy"}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "Request body must be a JSON object."),
        ({}, "'instruction' is required."),
        ({"instruction": "reboot"}, "Invalid instruction: 'reboot'."),
        ({"instruction": "retry", "params": []}, "'params' must be an object."),
        ({"instruction": "retry"}, "'request_id' must be a non-empty string."),
        ({"instruction": "retry", "request_id": ""}, "'request_id' must be a non-empty string."),
    ],
)
async def test_apply_checks_its_body_in_vllms_order(make_sim: SimFactory, body: Any, message: str) -> None:
    sim = await make_sim(**FT)
    assert await _apply(sim, body) == (
        400,
        {"error": {"message": message, "type": "Bad Request", "param": None, "code": 400}},
    )


async def test_apply_wants_json(make_sim: SimFactory) -> None:
    sim = await make_sim(**FT)
    status, body = await _apply(sim, {"instruction": "retry", "request_id": "r"}, content_type="text/plain")
    assert (status, body["error"]["message"]) == (
        400,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
    )


async def test_without_fault_tolerance_the_fault_kills_the_engine(make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34", watchdog_seconds=30)
    assert (await sim.api.get("/v1/fault_tolerance/status")).status == 404
    sim.engine.set_faults(["generate:engine-fault"])
    answer = await sim.api.completion(max_tokens=8)
    assert (answer.status, answer.body["error"]["message"]) == (500, ENGINE_DEAD_CLIENT_MESSAGE)
    assert (await sim.api.get("/health")).status == 503
