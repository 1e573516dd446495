"""Elastic EP's HTTP surface (serve/elastic_ep/): the status route, the scaling gate, and (0.33) retired ranks.

Against a real single-rank vLLM only the status route and the scale route's validation are exercised (a valid scale
would really reconfigure it); the scaling gate and retirement need a data-parallel deployment, so they run on the
simulator. Read in the wheels: 0.32's ScalingMiddleware answers every path, /health included, with 503
{"error": "The model is currently scaling..."}; 0.33's lets /health and /is_scaling_elastic_ep through and, on a rank a
scale-down retired, answers everything else 503 {"error": "This data-parallel rank has been retired..."} while
AsyncLLM.check_health returns early (healthy). /is_scaling_elastic_ep gains phase, epoch, error and the requested size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lifeguard_sim.engine import Engine
from tests.conformance.api import VllmApi, eventually

SCALING = {"error": "The model is currently scaling. Please try again later."}
RETIRED = {"error": "This data-parallel rank has been retired and is awaiting shutdown."}


@pytest.fixture
def restarted_after(sim_engine: Engine) -> Iterator[Engine]:
    """A retired rank or a failed commit only ends with the process: a fresh one for the next scenario."""
    yield sim_engine
    sim_engine.restart()


async def test_the_status_route_answers_in_each_releases_shape(vllm: VllmApi, vllm_version: str) -> None:
    answer = await vllm.post("/is_scaling_elastic_ep")
    assert answer.status == 200
    if vllm_version == "0.32":
        assert answer.body == {"is_scaling_elastic_ep": False}
    else:
        assert answer.body == {
            "is_scaling_elastic_ep": False,
            "phase": "idle",
            "epoch": None,
            "error": None,
            "requested_data_parallel_size": None,
        }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "new_data_parallel_size is required"),
        ({"new_data_parallel_size": 0}, "new_data_parallel_size must be a positive integer"),
        ({"new_data_parallel_size": "2"}, "new_data_parallel_size must be a positive integer"),
        ({"new_data_parallel_size": 2, "drain_timeout": -1}, "drain_timeout must be a positive integer"),
    ],
)
async def test_a_bad_scale_request_is_400_and_changes_nothing(
    vllm: VllmApi, body: dict[str, object], message: str
) -> None:
    answer = await vllm.call("POST", "/scale_elastic_ep", json_body=body)
    assert answer.status == 400
    assert answer.body["error"] == {"message": message, "type": "Bad Request", "param": None, "code": 400}
    assert (await vllm.post("/is_scaling_elastic_ep")).body["is_scaling_elastic_ep"] is False


async def _scale(vllm: VllmApi, size: int) -> asyncio.Task[object]:
    task = asyncio.create_task(vllm.call("POST", "/scale_elastic_ep", json_body={"new_data_parallel_size": size}))

    async def gated() -> bool:
        return (await vllm.get("/v1/models")).status == 503

    await eventually(gated, what="the scaling gate")
    return task


async def test_while_scaling_every_path_is_503_and_033_lets_health_and_status_through(
    vllm: VllmApi, vllm_version: str, sim_engine: Engine
) -> None:
    sim_engine.set_faults(["scale_elastic_ep:slow:0.5"])
    scale = await _scale(vllm, 2)
    models = await vllm.get("/v1/models")
    assert (models.status, models.body) == (503, SCALING)
    assert (await vllm.completion()).body == SCALING
    health = await vllm.get("/health")
    status = await vllm.post("/is_scaling_elastic_ep")
    if vllm_version == "0.32":
        assert (health.status, health.body) == (503, SCALING)
        assert (status.status, status.body) == (503, SCALING)
    else:
        assert health.status == 200
        assert status.body == {
            "is_scaling_elastic_ep": True,
            "phase": "committing",
            "epoch": 1,
            "error": None,
            "requested_data_parallel_size": 2,
        }
    answer = await asyncio.wait_for(scale, 10)
    assert answer.status == 200 and answer.body == {"message": "Scaled to 2 data parallel engines"}  # type: ignore[attr-defined]
    assert (await vllm.get("/v1/models")).status == 200
    if vllm_version != "0.32":
        assert (await vllm.post("/is_scaling_elastic_ep")).body["phase"] == "completed"


async def test_a_retired_rank_is_healthy_to_health_and_503_to_everything_else(
    vllm: VllmApi, vllm_version: str, restarted_after: Engine
) -> None:
    restarted_after.set_faults(["scale_elastic_ep:retire"])
    answer = await vllm.call("POST", "/scale_elastic_ep", json_body={"new_data_parallel_size": 2})
    assert answer.status == 200
    if vllm_version == "0.32":
        assert (await vllm.get("/v1/models")).status == 200  # 0.32 has no retired ranks
        return
    assert (await vllm.get("/health")).status == 200
    for path in ("/v1/models", "/is_sleeping", "/is_paused", "/version", "/metrics"):
        got = await vllm.get(path)
        assert (got.status, got.body) == (503, RETIRED), path
    assert (await vllm.completion()).body == RETIRED
    status = await vllm.post("/is_scaling_elastic_ep")
    assert status.body["is_scaling_elastic_ep"] is False and status.body["phase"] == "completed"


async def test_a_failed_commit_keeps_the_gate_up_and_the_status_says_failed(
    vllm: VllmApi, vllm_version: str, restarted_after: Engine
) -> None:
    restarted_after.set_faults(["scale_elastic_ep:scale-fails"])
    answer = await vllm.call("POST", "/scale_elastic_ep", json_body={"new_data_parallel_size": 2})
    assert answer.status == 500
    assert answer.body["error"]["message"] == "Scale failed"
    assert (await vllm.get("/v1/models")).body == SCALING
    if vllm_version != "0.32":
        status = await vllm.post("/is_scaling_elastic_ep")
        assert status.body["is_scaling_elastic_ep"] is False
        assert status.body["phase"] == "failed" and status.body["error"]
