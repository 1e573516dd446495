"""The 0.34 profile's checkpoint lifecycle beyond its HTTP answers (tests/conformance/test_checkpoint.py): the memory
it releases, the faults that fail it, an engine that starts prepared, and which flags attach the routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings, create_sim_app
from lifeguard_sim.errors import OOM_MESSAGE
from lifeguard_sim.memory import GIB
from tests.sim.conftest import Sim, SimFactory

V034 = {"vllm_version": "0.34"}


async def _status(sim: Sim) -> tuple[int, Any]:
    answer = await sim.api.get("/checkpoint/status")
    return answer.status, answer.body


async def test_prepare_releases_the_kv_cache_and_restore_maps_it_back(make_sim: SimFactory) -> None:
    sim = await make_sim(**V034)
    assert (await sim.api.post("/checkpoint/prepare")).body == {"state": "prepared"}
    state = await sim.state()
    assert state["memory"]["used_bytes"] == (16 + 2) * GIB  # weights and overhead stay, 40 GiB of KV cache go
    assert state["asleep_tags"] == ["kv_cache"]
    assert await sim.api.sleep_state_metric() == (1.0, 0.0, 0.0)  # the engine core prepares; nobody records a sleep
    assert (await sim.api.post("/checkpoint/restore")).body == {"state": "running"}
    assert (await sim.state())["memory"]["used_bytes"] == 58 * GIB
    assert (await sim.api.completion(max_tokens=4)).status == 200


async def test_a_failed_prepare_answers_200_with_the_failure_and_leaves_the_engine_failed(make_sim: SimFactory) -> None:
    """The route re-reads the state after the call: _finish_pause caught the error into FAILED."""
    sim = await make_sim(**V034, faults=("checkpoint_prepare:checkpoint-fails",))
    failed = {"state": "failed", "error": OOM_MESSAGE}
    prepare = await sim.api.post("/checkpoint/prepare")
    assert (prepare.status, prepare.body) == (200, failed)
    assert await _status(sim) == (500, failed)
    restore = await sim.api.post("/checkpoint/restore")
    assert (restore.status, restore.body) == (400, failed)
    assert (await sim.api.post("/checkpoint/prepare")).status == 400
    sleep = await sim.api.sleep(1)
    assert sleep.status == 500 and sleep.body["error"]["message"].endswith("the checkpoint state is failed")
    sim.engine.restart()  # only a restart leaves FAILED
    assert await _status(sim) == (503, {"state": "running"})


async def test_a_failed_restore_is_500_and_failed(make_sim: SimFactory) -> None:
    sim = await make_sim(**V034, faults=("checkpoint_restore:checkpoint-fails",))
    await sim.api.post("/checkpoint/prepare")
    restore = await sim.api.post("/checkpoint/restore")
    assert (restore.status, restore.body["error"]["message"]) == (
        500,
        f"Call to checkpoint_restore method failed: {OOM_MESSAGE}",
    )
    assert await _status(sim) == (500, {"state": "failed", "error": OOM_MESSAGE})


async def test_a_restore_that_does_not_fit_on_a_shared_device_fails_out_of_memory(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    gpu_file = tmp_path / "gpu.json"
    sim = await make_sim(**V034, gpu_file=gpu_file, gpu_file_engine="a", total_gib=60)
    await sim.api.post("/checkpoint/prepare")
    neighbour = await make_sim(gpu_file=gpu_file, gpu_file_engine="b", total_gib=60, weights_gib=1, kv_gib=1)
    neighbour.engine.publish()  # 4 GiB taken while the KV cache was released: 18 + 4 + 40 > 60
    restore = await sim.api.post("/checkpoint/restore")
    assert restore.status == 500
    assert (await _status(sim))[1]["state"] == "failed"


async def test_an_engine_started_prepared_serves_nothing_until_restored(make_sim: SimFactory) -> None:
    sim = await make_sim(**V034, checkpoint_prepare_on_startup=True)
    assert (await sim.api.get("/health")).status == 200
    assert await _status(sim) == (200, {"state": "prepared"})
    assert (await sim.api.completion(max_tokens=4)).status == 503
    assert (await sim.state())["memory"]["used_bytes"] == 18 * GIB
    assert (await sim.api.post("/checkpoint/restore")).body == {"state": "running"}
    assert (await sim.api.completion(max_tokens=4)).status == 200
    sim.engine.restart()  # a restarted process starts prepared again
    assert await _status(sim) == (200, {"state": "prepared"})


async def test_the_routes_follow_sleep_mode_not_dev_mode(make_sim: SimFactory) -> None:
    production = await make_sim(**V034, dev_mode=False)
    assert (await production.api.get("/checkpoint/status")).status == 503
    for path in ("/sleep", "/pause", "/collective_rpc", "/update_weights", "/reset_prefix_cache"):
        assert (await production.api.call("POST", path)).status == 404
    no_sleep_mode = await make_sim(**V034, sleep_mode=False)
    assert (await no_sleep_mode.api.get("/checkpoint/status")).status == 404


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"checkpoint_prepare_on_startup": True}, "is a vLLM 0.34 flag"),
        ({"vllm_version": "0.34", "checkpoint_prepare_on_startup": True, "sleep_mode": False}, "needs sleep mode"),
        ({"enable_fault_tolerance": True}, "modelled for vLLM 0.34 only"),
    ],
)
def test_settings_no_vllm_could_start_with_are_refused(overrides: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        create_sim_app(SimSettings(**overrides))
