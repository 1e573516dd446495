"""The route boundary, tried as a careless client and as an attacker would (raw sockets where a client
library would clean the request up first). Each repro of the route-boundary issue is a test here; the
engine's own counters (`/sim/state`) show whether a lifecycle call reached it behind the proxy's back."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings
from tests.e2e.conftest import FAST_SIM, Stack, raw_exchange, status_of

TOKEN = "s3cret-admin-token"
LORA = {"lora_name": "a", "lora_path": "/models/lora-a"}
#: A simulator that serves the LoRA routes (vLLM's --enable-lora) and SkyRL's own one.
LORA_SIM = SimSettings(**{**FAST_SIM.__dict__, "enable_lora": True, "trainer_servers": ("skyrl",)})


def _adapter(tmp_path: Path, name: str) -> dict[str, str]:
    """A LoRA adapter directory as trainers write it (the simulator loads one that has adapter_config.json)."""
    folder = tmp_path / f"lora-{name}"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "peft_type": "LORA"}')
    return {"lora_name": name, "lora_path": str(folder)}


def _post(target: str, *, body: bytes = b"", headers: str = "") -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nHost: proxy\r\nContent-Length: {len(body)}\r\n{headers}Connection: close\r\n\r\n"
    ).encode() + body


async def _first_response(stack: Stack, data: bytes, *, within: float) -> bytes:
    """Send `data` and read one whole response (by its Content-Length), which must come within `within` s."""
    server = stack.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(data)
        async with asyncio.timeout(within):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
        return head + body
    finally:
        writer.close()


def _json_body(raw: bytes) -> Any:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize(
    "target",
    ["/./sleep", "/v1/../sleep", "/%2e/sleep", "/v1/%2e%2e/sleep", "//sleep", "/./abort_requests", "/sleep/."],
)
async def test_a_dot_segment_never_reaches_vllm_as_a_lifecycle_call(
    make_stack: Callable[..., Awaitable[Stack]], target: str
) -> None:
    """Was: classified as an unknown POST (no token), forwarded as /sleep after yarl resolved the dots; the
    proxy said RUNNING and sent the next completion to a sleeping engine."""
    stack = await make_stack(admin_token=TOKEN)
    before = dict(stack.sim.counters)
    raw = await raw_exchange(stack, _post(target))
    assert status_of(raw) == 400, raw[:300]
    error = _json_body(raw)["error"]
    assert error["reason"] == "bad_request_target" and error["code"] == 400
    assert dict(stack.sim.counters) == before
    assert not stack.sim.is_sleeping
    assert (await stack.state())["state"] == "RUNNING"
    assert (await stack.completion()).status == 200


async def test_an_encoded_lifecycle_path_is_the_lifecycle_call_it_decodes_to(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """uvicorn decodes %65 before starlette routes, so /sl%65ep is vLLM's /sleep: it needs the token and goes
    through the state machine like /sleep."""
    stack = await make_stack(admin_token=TOKEN)
    refused = await raw_exchange(stack, _post("/sl%65ep?level=1"))
    assert status_of(refused) == 401
    assert stack.sim_count("sleep") == 0
    raw = await raw_exchange(stack, _post("/sl%65ep?level=1", headers=f"X-Lifeguard-Token: {TOKEN}\r\n"))
    assert status_of(raw) == 200, raw[:300]
    assert (await stack.state())["state"] == "SLEEPING" and stack.sim.is_sleeping


async def test_an_absolute_form_target_is_read_as_its_path(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    """Was: 503 proxy_error (the base URL and the absolute target were concatenated)."""
    stack = await make_stack()
    raw = await raw_exchange(stack, _post("http://vllm.example:8000/sleep?level=1"))
    assert status_of(raw) == 200, raw[:300]
    assert (await stack.state())["state"] == "SLEEPING"
    completion = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    held = asyncio.ensure_future(
        raw_exchange(stack, _post("http://vllm.example:8000/v1/completions", body=completion), read_for=10)
    )
    await stack.wait_held(1)
    assert (await stack.client.post("/wake_up")).status == 200
    assert status_of(await held) == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/release_kv_cache_memory", None),
        ("/v1/load_lora_adapter", LORA),
        ("/v1/unload_lora_adapter", {"lora_name": "a"}),
        ("/scale_elastic_ep", {"new_data_parallel_size": 2}),
        ("/weight_checker", {"action": "checksum"}),
        ("/start_profile", None),
        ("/fault_tolerance/apply", {"instruction": "retry", "params": {}}),
        ("/areal_update_weights", {"model_path": "/x"}),
        ("/some/route/nobody/knows", {}),
    ],
)
async def test_every_control_route_needs_the_token(
    make_stack: Callable[..., Awaitable[Stack]], path: str, body: Any
) -> None:
    """Was: forwarded with no token and no state machine (missing from the table)."""
    stack = await make_stack(admin_token=TOKEN)
    resp = await stack.client.post(path, json=body)
    assert resp.status == 401, await resp.text()
    assert resp.headers["X-Lifeguard-Reason"] == "unauthorized"


# ----- hold what must pass: trainers send these inside their weight sync
async def test_lora_load_while_paused_is_forwarded_not_held(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    """TRL's AsyncGRPOTrainer._sync_weight_lora: pause, /v1/load_lora_adapter, resume. Was: 503 hold_timeout."""
    stack = await make_stack(LORA_SIM, hold_timeout_s=2.0)
    assert (await stack.client.post("/pause", params={"mode": "keep"})).status == 200
    adapter = _adapter(tmp_path, "a")
    resp = await stack.client.post("/v1/load_lora_adapter", json=adapter)
    assert resp.status == 200, await resp.text()
    assert stack.sim.is_paused and stack.sim.lora_adapters == {"a": adapter["lora_path"]}  # loaded while paused
    assert (await stack.client.post("/resume")).status == 200


async def test_skyrl_colocated_lora_sync_passes_between_the_two_wakes(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    """SkyRL's fsdp_worker._save_lora_adapters_and_sync: wake_up?tags=weights, then its LoRA route, then
    wake_up?tags=kv_cache. Was: the LoRA call held until hold_timeout (the engine is still asleep)."""
    stack = await make_stack(LORA_SIM, hold_timeout_s=2.0)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    assert (await stack.client.post("/wake_up", params={"tags": "weights"})).status == 200
    adapters = {
        "/skyrl/v1/load_lora_adapter": _adapter(tmp_path, "a"),
        "/v1/load_lora_adapter": _adapter(tmp_path, "b"),
    }
    for path, adapter in adapters.items():
        resp = await stack.client.post(path, json=adapter)
        assert resp.status == 200, (path, await resp.text())
    # Both reached vLLM while its KV cache still slept.
    assert stack.sim.lora_adapters == {a["lora_name"]: a["lora_path"] for a in adapters.values()}
    assert stack.sim.state_dict()["asleep_tags"] == ["kv_cache"]
    assert (await stack.client.post("/wake_up", params={"tags": "kv_cache"})).status == 200
    assert (await stack.state())["state"] == "RUNNING"


async def test_areal_continue_generation_passes_once_its_pause_was_adopted(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """AReaL pauses vLLM through its own route; the proxy adopts PAUSED; the call that lifts it must pass."""
    stack = await make_stack(hold_timeout_s=2.0)
    await stack.sim.pause("abort")  # what /areal_pause_generation does inside AReaL's server
    await stack.wait_state("PAUSED")
    resp = await stack.client.post("/areal_continue_generation", json={})
    assert resp.status == 404  # vLLM's own answer (no AReaL server behind the simulator), not a hold
    assert resp.headers.get("X-Lifeguard-Reason") is None


async def test_an_unknown_route_is_forwarded_at_once_counted_and_logged_once(
    make_stack: Callable[..., Awaitable[Stack]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lifeguard.http")
    stack = await make_stack(hold_timeout_s=2.0)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    for n in (1, 2, 3):
        resp = await stack.client.post(f"/my_framework/v1/jobs/{n}", json={})
        assert resp.status == 404 and resp.headers.get("X-Lifeguard-Reason") is None
    logged = [r for r in caplog.records if getattr(r, "event", None) == "unknown_route"]
    assert len(logged) == 1 and logged[0].path == "/my_framework/v1/jobs/{id}"  # type: ignore[attr-defined]
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert (
        'lifeguard_unknown_route_requests_total{engine="default",method="POST",path="/my_framework/v1/jobs/{id}"} 3.0'
        in metrics
    )


async def test_unknown_routes_hold_keeps_the_old_behaviour(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(unknown_routes="hold", hold_timeout_s=0.5)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    resp = await stack.client.post("/my_framework/generate", json={})
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "hold_timeout"


async def test_declared_routes_are_classified_as_declared(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(routes={"inference": ["/my/generate"]}, hold_timeout_s=0.5)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    resp = await stack.client.post("/my/generate", json={})
    assert resp.status == 503 and resp.headers["X-Lifeguard-Reason"] == "hold_timeout"


async def test_a_serialized_control_call_waits_for_a_transition_in_progress(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """A LoRA load sent while a wake is running reaches vLLM only after the wake is verified."""
    stack = await make_stack()
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    stack.faults("wake_up:slow:0.5@1")
    wake = asyncio.ensure_future(stack.client.post("/wake_up"))
    await stack.wait_state("WAKING")
    lora = await stack.client.post("/v1/load_lora_adapter", json=LORA)
    assert wake.done(), "the LoRA call was answered while the wake was still in progress"
    assert (await wake).status == 200 and lora.headers.get("X-Lifeguard-Reason") is None


# ----- errors say what happened
async def test_a_vllm_4xx_to_a_lifecycle_call_is_relayed_as_vllm_said_it(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """Was: `/update_weights -d ''` became a retryable 503 upstream_error."""
    stack = await make_stack()
    resp = await stack.client.post("/update_weights", data=b"", headers={"Content-Type": "application/json"})
    assert resp.status == 400, await resp.text()
    assert "Retry-After" not in resp.headers
    body = await resp.json()
    assert body["error"]["code"] == 400 and "src" not in body["error"]  # vLLM's own body, not ours
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_redirect_from_vllm_points_back_at_the_proxy(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    resp = await stack.client.get("/v1/models/", allow_redirects=False)
    assert resp.status == 307
    assert resp.headers["Location"] == "/v1/models"
    followed = await stack.client.get("/v1/models/")
    assert followed.status == 200 and (await followed.json())["data"]


async def test_a_non_utf8_admin_token_is_401(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    """Was: 503 proxy_error (UnicodeEncodeError comparing the token)."""
    stack = await make_stack(admin_token=TOKEN)
    request = b"POST /sleep HTTP/1.1\r\nHost: p\r\nX-Lifeguard-Token: \xff\xfe\r\nContent-Length: 0\r\n\r\n"
    raw = await raw_exchange(stack, request)
    assert status_of(raw) == 401, raw[:300]
    assert stack.sim_count("sleep") == 0


# ----- secrets and memory at the door
async def test_the_token_is_checked_before_a_lifecycle_body_is_read(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    """Was: the proxy buffered (or waited for) the whole body first, then said 401."""
    stack = await make_stack(admin_token=TOKEN, client_body_timeout_s=30.0)
    request = b"POST /collective_rpc HTTP/1.1\r\nHost: p\r\nContent-Length: 50000000\r\n\r\n" + b"{" * 1000
    raw = await _first_response(stack, request, within=15)  # was: no answer until the 30 s body deadline
    assert status_of(raw) == 401, raw[:300]
    assert b"connection: close" in raw.lower()


async def test_a_declared_length_over_the_limit_is_413_at_once(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(max_body_bytes=4096, client_body_timeout_s=30.0)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 100
    raw = await _first_response(stack, request, within=15)  # was: no answer until the 30 s body deadline
    assert status_of(raw) == 413, raw[:300]
    assert _json_body(raw)["error"]["reason"] == "body_too_large"
    assert b"connection: close" in raw.lower()
    assert stack.sim_count("generate") == 0


async def test_held_bodies_have_a_byte_budget(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    """Was: 10,000 held requests of up to 64 MiB each could be buffered."""
    stack = await make_stack(max_held_bytes=10_000)
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    first = asyncio.ensure_future(stack.completion(prompt="a" * 6000))
    await stack.wait_held(1)
    second = await stack.completion(prompt="b" * 6000)
    assert second.status == 503 and second.headers["X-Lifeguard-Reason"] == "hold_queue_full"
    assert "Retry-After" in second.headers
    small = asyncio.ensure_future(stack.completion(prompt="c"))
    await stack.wait_held(2)
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await first).status == 200 and (await small).status == 200


async def test_an_upstream_password_is_never_shown(
    make_stack: Callable[..., Awaitable[Stack]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    probe = await make_stack()
    url = probe.settings.upstream
    assert url is not None
    with_password = url.replace("http://", "http://trainer:hunter2pw@")
    stack = await make_stack(upstream=with_password)
    state = await (await stack.client.get("/lifeguard/state")).text()
    assert "hunter2pw" not in state and "trainer:***@" in state
    assert all("hunter2pw" not in record.getMessage() for record in caplog.records)


# ----- /release_kv_cache_memory: the KV cache freed, the engine partly asleep
async def test_release_kv_cache_memory_holds_inference_until_the_kv_cache_wakes(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await make_stack()
    refused = await stack.client.post("/release_kv_cache_memory")
    assert refused.status == 409 and refused.headers["X-Lifeguard-Reason"] == "not_paused"
    assert stack.sim_count("release_kv_cache_memory") == 0
    assert (await stack.client.post("/pause", params={"mode": "abort"})).status == 200
    released = await stack.client.post("/release_kv_cache_memory")
    assert released.status == 200, await released.text()
    assert (await released.json()) == {"status": "kv_cache_released"}
    assert "memory=pass" in released.headers["X-Lifeguard-Verified"]
    state = await stack.state()
    assert state["state"] == "SLEEPING" and state["asleep_tags"] == ["kv_cache"]
    assert stack.sim.state_dict()["memory"]["resident"] == ["weights"]  # type: ignore[index]
    again = await stack.client.post("/release_kv_cache_memory")
    assert again.status == 200 and again.headers["X-Lifeguard-Noop"] == "true"
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    woke = await stack.client.post("/wake_up", params={"tags": "kv_cache"})
    assert woke.status == 200, await woke.text()
    assert woke.headers["X-Lifeguard-Pause-Kept"] == "abort"  # the user's pause outlives the release
    assert (await stack.state())["state"] == "PAUSED"
    assert (await stack.client.post("/resume")).status == 200
    assert (await held).status == 200
    assert not stack.sim.violations
