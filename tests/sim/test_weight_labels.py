"""Which weights produced an answer: a failed chunk that leaves them partial, tokens that follow a change of weights
mid-stream, and the journal's record of each answer (`Engine.on_answer`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lifeguard_sim.versions import ENGINE_DEAD_CLIENT_MESSAGE
from lifeguard_sim.weight_checker import checksums
from tests.chaos.chaos_checks import journal_entries
from tests.chaos.sim_process import Journal, instrument
from tests.conformance.api import StreamResult, eventually, settled_chunks
from tests.sim.conftest import Sim, SimFactory

PARTIAL_MESSAGE = (
    "Call to collective_rpc method failed: Worker failed with error 'IPC handle not found for GPU UUID GPU-sim-0. "
    "Available UUIDs: ['GPU-trainer-0']'"
)


async def _post(sim: Sim, path: str, body: dict[str, Any] | None = None) -> Any:
    return await sim.api.call("POST", path, json_body=body)


async def _start_and_fail_a_chunk(sim: Sim) -> None:
    assert (await _post(sim, "/start_weight_update")).status == 200
    assert (await _post(sim, "/update_weights", {"update_info": {}})).status == 200
    sim.engine.set_faults(["update_weights:partial"])
    failed = await _post(sim, "/update_weights", {"update_info": {}})
    assert (failed.status, failed.body["error"]["message"]) == (500, PARTIAL_MESSAGE)


async def test_a_chunk_that_fails_mid_way_ends_the_session_and_the_next_completion_kills_the_engine(
    make_sim: SimFactory,
) -> None:
    sim = await make_sim(watchdog_seconds=30)
    await _start_and_fail_a_chunk(sim)
    state = await sim.state()
    assert (state["weight_update_active"], state["weights_partial"]) == (False, True)
    # The worker ended the session, so the finish is refused and publishes no label (v1/worker/gpu_worker.py).
    finish = await _post(sim, "/finish_weight_update", {"weight_version": "v2"})
    assert finish.status == 500
    assert "finish_weight_update called without a matching start_weight_update." in finish.body["error"]["message"]
    assert (await sim.api.get("/weight_info")).body == {"weight_version": "default"}
    assert (await sim.api.get("/health")).status == 200  # nothing has stepped yet
    answer = await sim.api.completion(max_tokens=4)
    assert (answer.status, answer.body["error"]["message"]) == (500, ENGINE_DEAD_CLIENT_MESSAGE)
    assert (await sim.api.get("/health")).status == 503


@pytest.mark.parametrize("replace", ["a finished session", "reload_weights"])
async def test_weights_replaced_before_any_step_are_whole_again(make_sim: SimFactory, replace: str) -> None:
    sim = await make_sim()
    before = checksums(sim.engine)
    await _start_and_fail_a_chunk(sim)
    assert checksums(sim.engine) != before  # the digests see half-written weights
    if replace == "reload_weights":
        assert (await _post(sim, "/collective_rpc", {"method": "reload_weights"})).status == 200
    else:
        for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
            assert (await _post(sim, path, {"update_info": {}} if path == "/update_weights" else None)).status == 200
    assert not (await sim.state())["weights_partial"]
    assert (await sim.api.completion(max_tokens=4)).status == 200
    assert (await sim.api.get("/health")).status == 200


async def test_tokens_after_a_change_of_weights_mid_stream_follow_the_new_weights(make_sim: SimFactory) -> None:
    """A keep-mode pause, a whole update labelled v2, a resume: the stream's tokens after the split are what the new
    weights answer for the prompt and the text before it, and the spans say where."""
    sim = await make_sim(vllm_version="0.33", token_seconds=0.004)
    result = StreamResult()
    prompt = "Count upward slowly: one, two, three,"
    stream = asyncio.create_task(sim.api.stream_completion(result, max_tokens=60, return_weight_versions=True))
    await asyncio.wait_for(result.first_text.wait(), 10)
    assert (await sim.api.post("/pause", mode="keep")).status == 200
    split = await settled_chunks(result, quiet_s=0.2)
    for path in ("/start_weight_update", "/update_weights"):
        assert (await _post(sim, path, {"update_info": {}} if path == "/update_weights" else None)).status == 200
    assert (await _post(sim, "/finish_weight_update", {"weight_version": "v2"})).status == 200
    assert (await sim.api.post("/resume")).status == 200
    await asyncio.wait_for(stream, 30)
    texts = [c["choices"][0]["text"] for c in result.chunks if c["choices"] and c["choices"][0]["text"]]
    assert [c["choices"][0] for c in result.chunks if c["choices"]][-1]["weight_versions"] == [
        {"version": "default", "start": 0, "end": split},
        {"version": "v2", "start": split, "end": 60},
    ]
    assert (await sim.api.post("/reset_prefix_cache")).body == {"success": True}  # no block of the old weights
    fresh = await sim.api.completion(prompt + "".join(texts[:split]), max_tokens=60 - split, ignore_eos=True)
    assert "".join(texts[split:]) == fresh.body["choices"][0]["text"]


async def test_each_answer_is_told_with_its_labels_and_its_weights(make_sim: SimFactory) -> None:
    sim = await make_sim()
    told: list[dict[str, Any]] = []
    sim.engine.on_answer = told.append
    await sim.api.completion(max_tokens=3, ignore_eos=True)
    await _post(sim, "/update_weight_version", {"new_version": "relabelled"})
    await sim.api.completion(max_tokens=3, ignore_eos=True)

    async def both() -> bool:
        return len(told) == 2

    await eventually(both, what="two answers told")
    assert [(a["finish_reason"], a["weight_versions"]) for a in told] == [
        ("length", [{"version": "default", "start": 0, "end": 3}]),
        ("length", [{"version": "relabelled", "start": 0, "end": 3}]),
    ]
    # The label changed, the weights did not: the record tells them apart.
    assert told[0]["weights"] == told[1]["weights"] == [{"weights": "0", "start": 0, "end": 3}]


async def test_the_chaos_journal_records_each_answers_labels_and_weights(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = await make_sim()
    path = tmp_path / "journal.jsonl"
    instrument(sim.engine, Journal(str(path)))
    await _post(sim, "/update_weight_version", {"new_version": "step-3"})
    await sim.api.completion(max_tokens=2, ignore_eos=True)

    async def answered() -> bool:
        return any(e["ev"] == "answer" for e in journal_entries(path))

    await eventually(answered, what="an answer line in the journal")
    [answer] = [e for e in journal_entries(path) if e["ev"] == "answer"]
    assert answer["weight_versions"] == [{"version": "step-3", "start": 0, "end": 2}]
    assert answer["weights"] == [{"weights": "0", "start": 0, "end": 2}]
