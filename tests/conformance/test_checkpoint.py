"""vLLM 0.34's process-checkpoint lifecycle: POST /checkpoint/prepare and /checkpoint/restore, GET /checkpoint/status.

The answers below are what the 0.34 wheel's code writes (vllm/entrypoints/serve/checkpoint/api_router.py, the
`CheckpointState` of vllm/v1/engine/__init__.py, `EngineCoreProc.checkpoint_prepare/restore` and the guards of
`EngineCore.sleep/wake_up/resume_scheduler` in vllm/v1/engine/core.py): a `{"state", "error"}` body without a null
error; status 200 only when prepared, 500 when failed, else 503; prepare 400 with the reason on an engine asleep;
while not running, /sleep and /wake_up fail as a utility call does (`Call to <method> method failed: ...`) and /resume
with its own `Failed to resume generation: ...`; new requests meanwhile get the retryable `engine_paused` refusal of a
user pause (abort and wait modes; keep queues them).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conformance.api import VllmApi, engine_holds_one, still_pending
from tests.conformance.conftest import on_profiles
from tests.conformance.test_pause_refusal import PAUSED_BODY, _raw

pytestmark = on_profiles("0.34")


@pytest.fixture(autouse=True)
def _on_034_only(vllm_version: str) -> None:
    """Against a real engine of another release (vLLM-for-CPU is 0.32), there is nothing to check."""
    if vllm_version != "0.34":
        pytest.skip(f"the checkpoint lifecycle is vLLM 0.34's; this engine is {vllm_version}")


PREPARED = {"state": "prepared"}
RUNNING = {"state": "running"}


def _dev_error(method: str, message: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Call to {method} method failed: {message}",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


async def _prepare(vllm: VllmApi, **params: str) -> Any:
    return await vllm.call("POST", "/checkpoint/prepare", params=params or None)


async def test_an_idle_engine_prepares_at_once_and_restores(vllm: VllmApi) -> None:
    status = await vllm.get("/checkpoint/status")
    assert (status.status, status.body) == (503, RUNNING)
    prepared = await _prepare(vllm)
    assert (prepared.status, prepared.body) == (200, PREPARED)
    status = await vllm.get("/checkpoint/status")
    assert (status.status, status.body) == (200, PREPARED)
    repeat = await _prepare(vllm)
    assert (repeat.status, repeat.body) == (200, PREPARED)  # a no-op
    restored = await vllm.post("/checkpoint/restore")
    assert (restored.status, restored.body) == (200, RUNNING)
    again = await vllm.post("/checkpoint/restore")
    assert (again.status, again.body) == (200, RUNNING)  # idempotent
    assert (await vllm.completion(max_tokens=4)).status == 200


async def test_a_prepared_engine_is_healthy_and_refuses_every_request(vllm: VllmApi) -> None:
    await _prepare(vllm)
    assert (await vllm.get("/health")).status == 200
    assert await vllm.is_sleeping() and await vllm.is_paused()
    body = {"model": vllm.model, "prompt": "Count upward slowly:", "max_tokens": 4}
    status, _, raw = await _raw(vllm, "/v1/completions", body)
    assert (status, raw) == (503, PAUSED_BODY)
    assert (await vllm.post("/checkpoint/restore")).status == 200


async def test_sleep_wake_and_resume_fail_while_not_running(vllm: VllmApi) -> None:
    await _prepare(vllm)
    sleep = await vllm.sleep(1)
    assert (sleep.status, sleep.body) == (
        500,
        _dev_error("sleep", "Cannot sleep while the checkpoint state is prepared"),
    )
    wake = await vllm.wake()
    assert (wake.status, wake.body) == (
        500,
        _dev_error("wake_up", "Cannot wake up while the checkpoint state is prepared"),
    )
    resume = await vllm.post("/resume")
    assert (resume.status, resume.body) == (
        500,
        {
            "error": "Failed to resume generation: Call to resume_scheduler method failed: "
            "Cannot resume scheduling while the checkpoint state is prepared"
        },
    )
    assert (await vllm.post("/checkpoint/restore")).body == RUNNING


async def test_prepare_is_refused_400_while_asleep(vllm: VllmApi) -> None:
    await vllm.sleep(1)
    answer = await _prepare(vllm)
    assert (answer.status, answer.body) == (
        400,
        {"state": "running", "error": "Preparing for a checkpoint requires an awake engine"},
    )
    assert (await vllm.get("/checkpoint/status")).body == RUNNING


async def test_a_wait_mode_prepare_is_preparing_until_the_running_request_ends(vllm: VllmApi) -> None:
    request = asyncio.create_task(vllm.completion(max_tokens=200, ignore_eos=True))
    await engine_holds_one(vllm)
    started = await _prepare(vllm, mode="wait")
    assert (started.status, started.body) == (200, {"state": "preparing"})
    status = await vllm.get("/checkpoint/status")
    assert (status.status, status.body) == (503, {"state": "preparing"})
    restore = await vllm.post("/checkpoint/restore")
    assert (restore.status, restore.body) == (400, {"state": "preparing"})
    assert (await asyncio.wait_for(request, 30)).status == 200  # the drain lets it finish
    assert (await vllm.get("/checkpoint/status")).body == PREPARED
    assert (await vllm.post("/checkpoint/restore")).body == RUNNING


async def test_a_keep_mode_prepare_queues_new_requests_until_the_restore(vllm: VllmApi) -> None:
    assert (await _prepare(vllm, mode="keep")).body == PREPARED
    request = asyncio.create_task(vllm.completion(max_tokens=4))
    await engine_holds_one(vllm)
    assert await still_pending(request)
    assert (await vllm.post("/checkpoint/restore")).body == RUNNING
    assert (await asyncio.wait_for(request, 30)).status == 200


async def test_an_unknown_mode_is_fastapis_400(vllm: VllmApi) -> None:
    answer = await _prepare(vllm, mode="later")
    assert (answer.status, answer.body["error"]["param"]) == (400, "query.mode")


@pytest.mark.parametrize("path", ["/sleep", "/release_kv_cache_memory"])
async def test_reset_connector_is_a_boolean_query(vllm: VllmApi, path: str) -> None:
    answer = await vllm.call("POST", path, params={"reset_connector": "maybe"})
    assert (answer.status, answer.body["error"]["param"]) == (400, "query.reset_connector")
