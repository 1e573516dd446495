"""The weight version the proxy vouches for (issue 51), end to end against the simulator's 0.33 profile: the header on
every answer, the labels in vLLM's spans, a failed chunk that taints its session, a relabel with no change, the
staleness of what was relayed, and the version across a proxy restart (docs/guides/weight-versions.md)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings
from tests.conformance.api import StreamResult, VllmApi, settled_chunks
from tests.e2e.conftest import FAST_SIM, Stack

SIM_033 = SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.33"})
HEADER = "X-Lifeguard-Weight-Version"
ASK = {"return_weight_versions": True, "ignore_eos": True}


async def _post(stack: Stack, path: str, body: Any = None) -> Any:
    return await stack.client.post(path, json=body)


async def _session(stack: Stack, label: str | None = None) -> Any:
    for path, body in (("/start_weight_update", None), ("/update_weights", {"update_info": {}})):
        resp = await _post(stack, path, body)
        assert resp.status == 200, await resp.text()
    return await _post(stack, "/finish_weight_update", {"weight_version": label} if label is not None else None)


async def _asked(stack: Stack, max_tokens: int = 3) -> tuple[str, list[dict[str, Any]]]:
    resp = await stack.completion(max_tokens=max_tokens, **ASK)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    return resp.headers[HEADER], body["choices"][0]["weight_versions"]


async def _metric(stack: Stack, name: str) -> float:
    text = await (await stack.client.get("/lifeguard/metrics")).text()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_each_change_of_weights_is_a_new_version_named_on_every_answer_and_in_the_spans(make_stack: Any) -> None:
    stack: Stack = await make_stack(SIM_033)
    assert await _asked(stack) == ("lifeguard-0", [{"version": "lifeguard-0", "start": 0, "end": 3}])

    assert (await _session(stack)).status == 200  # no label sent: the proxy's own is published, in vLLM too
    assert stack.sim.weight_version == "lifeguard-1"
    assert await _asked(stack) == ("lifeguard-1", [{"version": "lifeguard-1", "start": 0, "end": 3}])

    assert (await _session(stack, "step-7")).status == 200
    assert await _asked(stack) == ("step-7", [{"version": "step-7", "start": 0, "end": 3}])

    # A reload sets no label of vLLM's own: the proxy names it, and tells vLLM.
    assert (await _post(stack, "/collective_rpc", {"method": "reload_weights"})).status == 200
    assert stack.sim.weight_version == "lifeguard-3"
    assert await _asked(stack) == ("lifeguard-3", [{"version": "lifeguard-3", "start": 0, "end": 3}])
    plain = await stack.completion()
    assert plain.headers[HEADER] == "lifeguard-3" and (await plain.json())["choices"][0]["weight_versions"] is None

    version = (await stack.state())["weight_version"]
    assert (version["generation"], version["label"], version["partial_after"]) == (3, "lifeguard-3", None)
    assert await _metric(stack, 'lifeguard_weight_version_generation{engine="default"}') == 3


async def test_a_label_set_behind_the_proxys_back_is_not_what_the_spans_say(make_stack: Any) -> None:
    stack: Stack = await make_stack(SIM_033)
    assert (await _session(stack, "v1")).status == 200
    stack.sim.update_weight_version("v9")  # sent to vLLM directly: no weights changed
    assert await _asked(stack) == ("v1", [{"version": "v1", "start": 0, "end": 3}])
    stream = await stack.completion(max_tokens=3, stream=True, **ASK)
    text = await stream.text()
    assert stream.headers[HEADER] == "v1"
    assert '"weight_versions":[{"version":"v1","start":0,"end":3}]' in text and "v9" not in text


@pytest.mark.parametrize("vllm_version", ["0.33", "0.32"])
async def test_a_stream_across_a_keep_mode_update_is_split_where_the_new_weights_began(
    make_stack: Any, vllm_version: str
) -> None:
    """0.33: vLLM's spans, relabelled; 0.32 gives none: the proxy's own, from the tokens it relayed before the pause
    and after the resume, are the same spans, token for token."""
    stack: Stack = await make_stack(
        SimSettings(**{**FAST_SIM.__dict__, "vllm_version": vllm_version, "token_seconds": 0.004})
    )
    api = VllmApi(stack.client.session, str(stack.client.make_url("")), "tiny")
    result = StreamResult()
    stream = asyncio.create_task(api.stream_completion(result, max_tokens=60, return_weight_versions=True))
    await asyncio.wait_for(result.first_text.wait(), 10)
    assert (await stack.client.post("/pause", params={"mode": "keep"})).status == 200
    split = await settled_chunks(result, quiet_s=0.2)
    before = await _metric(stack, 'lifeguard_tokens_total{engine="default",version_lag="1"}')
    assert (await _session(stack, "v2")).status == 200
    assert (await stack.client.post("/resume")).status == 200
    await asyncio.wait_for(stream, 30)
    assert [c["choices"][0] for c in result.chunks if c["choices"]][-1]["weight_versions"] == [
        {"version": "lifeguard-0", "start": 0, "end": split},
        {"version": "v2", "start": split, "end": 60},
    ]
    # Dispatched on generation 0, ended with generation 1 the newest: its tokens were a version behind.
    assert await _metric(stack, 'lifeguard_tokens_total{engine="default",version_lag="1"}') - before == 60
    assert await _metric(stack, 'lifeguard_request_version_lag_count{engine="default"}') >= 1


async def test_a_chunk_that_failed_taints_its_session_and_no_label_is_published_on_partial_weights(
    make_stack: Any,
) -> None:
    stack: Stack = await make_stack(SIM_033, hold_timeout_s=20.0)
    assert (await _session(stack, "v1")).status == 200
    assert (await _post(stack, "/start_weight_update")).status == 200
    assert (await _post(stack, "/update_weights", {"update_info": {}})).status == 200
    stack.faults("update_weights:partial")
    failed = await _post(stack, "/update_weights", {"update_info": {}})
    assert (failed.status, failed.headers["X-Lifeguard-Reason"]) == (503, "upstream_error")
    held = stack.completion_in_background()
    await stack.wait_held(1)

    again = await _post(stack, "/update_weights", {"update_info": {}})
    assert again.status == 409 and (await again.json())["error"]["reason"] == "weights_partial"
    finish = await _post(stack, "/finish_weight_update", {"weight_version": "v2"})
    assert finish.status == 409
    error = (await finish.json())["error"]
    assert error["reason"] == "weights_partial"
    assert error["message"].startswith("/update_weights (vLLM answered /update_weights with 500")
    state = await stack.state()
    assert (state["weight_update_active"], state["weights_stale_reason"]) == (False, "partial")
    assert (state["weight_version"]["label"], stack.sim.weight_version) == ("v1", "v1")  # never v2
    assert state["held_requests"] == 1  # nothing ran on the partial weights, so the engine lives
    assert await _metric(stack, 'lifeguard_weight_updates_partial_total{engine="default"}') == 1

    assert (await _session(stack, "v3")).status == 200  # a whole session: the weights are whole again
    answer = await held
    assert answer.status == 200 and answer.headers[HEADER] == "v3"
    assert stack.sim.state_dict()["violations"] == []
    assert (await stack.client.get("/health")).status == 200


async def test_a_relabel_without_a_change_is_passed_on_and_said(make_stack: Any) -> None:
    stack: Stack = await make_stack(SIM_033)
    first = await _post(stack, "/update_weight_version", {"new_version": "a"})
    assert first.status == 200 and first.headers["X-Lifeguard-Weights-Unchanged"] == "unknown"
    assert (await _session(stack, "v1")).status == 200
    same = await _post(stack, "/update_weight_version", {"new_version": "v1-renamed"})
    assert same.status == 200 and same.headers["X-Lifeguard-Weights-Unchanged"] == "true"
    assert stack.sim.weight_version == "v1-renamed"
    assert await _metric(stack, 'lifeguard_weight_relabels_unchanged_total{engine="default"}') == 1
    assert (await _session(stack)).status == 200
    changed = await _post(stack, "/update_weight_version", {"new_version": "v2"})
    assert changed.headers["X-Lifeguard-Weights-Unchanged"] == "false"
    assert await _asked(stack) == ("v2", [{"version": "v2", "start": 0, "end": 3}])


async def test_the_version_outlives_a_proxy_restart(make_stack: Any, serve_lifeguard: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack(SIM_033, state_file=str(tmp_path / "state.json"))
    assert (await _session(stack, "v5")).status == 200
    await stack.client.close()
    restarted = await serve_lifeguard(stack.settings)
    resp = await restarted.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200 and resp.headers[HEADER] == "v5"
    version = (await (await restarted.get("/lifeguard/state")).json())["weight_version"]
    assert (version["generation"], version["label"]) == (1, "v5")


async def test_on_vllm_032_a_whole_answer_that_asked_gets_the_proxys_own_span(make_stack: Any) -> None:
    stack: Stack = await make_stack(SimSettings(**{**FAST_SIM.__dict__, "vllm_version": "0.32"}))
    assert (await _session(stack, "v1")).status == 200
    assert await _asked(stack, max_tokens=5) == ("v1", [{"version": "v1", "start": 0, "end": 5}])
    plain = await stack.completion()
    assert "weight_versions" not in (await plain.json())["choices"][0]  # not asked: vLLM 0.32's answer as it was


async def test_a_version_is_bound_to_the_digest_of_vllms_checksums_read_after_its_change(make_stack: Any) -> None:
    stack: Stack = await make_stack(SIM_033, weight_checksums="always")
    assert (await stack.state())["weight_version"]["digest"] is None  # generation 0: nothing read after a change
    assert (await _session(stack, "v1")).status == 200
    first = (await stack.state())["weight_version"]
    assert first["label"] == "v1" and isinstance(first["digest"], str)
    assert (await _session(stack, "v2")).status == 200
    second = (await stack.state())["weight_version"]
    assert second["generation"] == 2 and second["digest"] not in (None, first["digest"])


async def _weight_info(stack: Stack) -> dict[str, Any]:
    resp = await stack.client.get("/weight_info")
    assert resp.status == 200, await resp.text()
    info: dict[str, Any] = await resp.json()
    return info


async def test_weight_info_names_the_vouched_version_beside_vllms_own_label(make_stack: Any) -> None:
    """vLLM's `/weight_info` says whatever label it was last sent; through the proxy its `weight_version` is the one
    the proxy vouches for, vLLM's is kept beside it, and partial weights are said."""
    stack: Stack = await make_stack(SIM_033)
    assert (await _session(stack, "v1")).status == 200
    stack.sim.update_weight_version("v9")  # sent to vLLM directly: no weights changed
    info = await _weight_info(stack)
    assert (info["weight_version"], info["vllm_weight_version"], info["generation"]) == ("v1", "v9", 1)
    assert (info["weights_partial"], info["partial_after"]) == (False, None)

    assert (await _post(stack, "/start_weight_update")).status == 200
    stack.faults("update_weights:partial")
    assert (await _post(stack, "/update_weights", {"update_info": {}})).status == 503
    assert (await _post(stack, "/finish_weight_update", {"weight_version": "v2"})).status == 409
    info = await _weight_info(stack)
    assert (info["weight_version"], info["weights_partial"]) == ("v1", True)
    assert info["partial_after"].startswith("/update_weights")

    assert (await _post(stack, "/collective_rpc", {"method": "reload_weights"})).status == 200
    info = await _weight_info(stack)
    assert (info["weight_version"], info["generation"], info["weights_partial"]) == ("lifeguard-2", 2, False)
