"""Who may drive the lifecycle, what reaches vLLM, and what reaches the logs.

Lifecycle and weight routes take the admin token (`Authorization: Bearer` or `X-Lifeguard-Token`) when
`admin_token` is set; inference auth belongs to vLLM and passes through untouched; hop-by-hop headers are
stripped both ways and nothing is added (no X-Forwarded-For: TRL reads it as the NCCL host).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from proxy.config import Settings
from proxy.front.route_table import VLLM_ROUTES, RouteKind
from tests.e2e.conftest import Stack
from tests.e2e.test_startup_errors import free_port, line_with, port_in_use, run, serving

TOKEN = "s3cret-admin-token-4f9a"
INFERENCE_KEY = "sk-user-key-77c1"

# A valid call per route, so that only the token decides the answer.
VALID: dict[str, tuple[dict[str, str], Any]] = {
    "/sleep": ({"level": "1"}, None),
    "/wake_up": ({}, None),
    "/pause": ({"mode": "keep"}, None),
    "/resume": ({}, None),
    "/start_weight_update": ({}, None),
    "/update_weights": ({}, {"update_info": {}}),
    "/finish_weight_update": ({}, None),
    "/collective_rpc": ({}, {"method": "reload_weights"}),
    "/init_weight_transfer_engine": ({}, {"init_info": {}}),
    "/update_weight_version": ({}, {"new_version": "v2"}),
    "/abort_requests": ({}, {"request_ids": []}),
    "/reset_prefix_cache": ({}, None),
}
# Every POST control route of vLLM's that the token guards (templated ones need a concrete path, left out).
GUARDED = sorted(
    path
    for methods, path, kind in VLLM_ROUTES
    if kind in (RouteKind.LIFECYCLE, RouteKind.AT_ONCE, RouteKind.SERIALIZED) and "POST" in methods and "{" not in path
)


def _call(path: str) -> tuple[dict[str, str], Any]:
    return VALID.get(path, ({}, None))


@pytest.mark.parametrize("path", GUARDED)
async def test_a_guarded_route_without_the_token_is_401_and_never_reaches_vllm(
    make_stack: Callable[..., Awaitable[Stack]], path: str
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    before = dict(stack.sim.counters)
    params, body = _call(path)
    resp = await stack.client.post(path, params=params, json=body)
    assert resp.status == 401, await resp.text()
    assert resp.headers["X-Lifeguard-Reason"] == "unauthorized"
    assert (await resp.json())["error"]["type"] == "AuthenticationError"
    assert dict(stack.sim.counters) == before


@pytest.mark.parametrize("header", ["Authorization", "X-Lifeguard-Token"])
@pytest.mark.parametrize("path", GUARDED)
async def test_a_guarded_route_with_a_wrong_token_is_403(
    make_stack: Callable[..., Awaitable[Stack]], path: str, header: str
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    before = dict(stack.sim.counters)
    value = "Bearer not-the-token" if header == "Authorization" else "not-the-token"
    params, body = _call(path)
    resp = await stack.client.post(path, params=params, json=body, headers={header: value})
    assert resp.status == 403, await resp.text()
    assert resp.headers["X-Lifeguard-Reason"] == "forbidden"
    assert dict(stack.sim.counters) == before


@pytest.mark.parametrize("header", ["Authorization", "X-Lifeguard-Token"])
@pytest.mark.parametrize("path", GUARDED)
async def test_a_guarded_route_with_the_token_is_let_through(
    make_stack: Callable[..., Awaitable[Stack]], path: str, header: str
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    value = f"Bearer {TOKEN}" if header == "Authorization" else TOKEN
    params, body = _call(path)
    resp = await stack.client.post(path, params=params, json=body, headers={header: value})
    assert resp.status not in (401, 403), await resp.text()
    assert resp.headers.get("X-Lifeguard-Reason") not in ("unauthorized", "forbidden")


async def test_the_bearer_scheme_is_case_insensitive_and_a_token_prefix_is_not_enough(
    make_stack: Callable[..., Awaitable[Stack]],
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    ok = await stack.client.post("/pause", params={"mode": "keep"}, headers={"Authorization": f"bearer {TOKEN}"})
    assert ok.status == 200
    prefix = await stack.client.post("/resume", headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
    assert prefix.status == 403
    longer = await stack.client.post("/resume", headers={"X-Lifeguard-Token": TOKEN + "x"})
    assert longer.status == 403


async def test_without_an_admin_token_the_lifecycle_is_open(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    resp = await stack.client.post("/pause", params={"mode": "keep"})
    assert resp.status == 200


async def test_inference_needs_no_admin_token(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack(admin_token=TOKEN)
    resp = await stack.completion()
    assert resp.status == 200


async def test_probes_and_metrics_need_no_token(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    """Kubelet probes and Prometheus carry no token; the state (hosts, errors) and the status page do need it."""
    stack = await make_stack(admin_token=TOKEN)
    for path in ("/lifeguard/healthz", "/lifeguard/readyz", "/lifeguard/serving", "/lifeguard/metrics"):
        assert (await stack.client.get(path)).status == 200, path
    for path in ("/lifeguard/state", "/lifeguard/ui"):
        refused = await stack.client.get(path)
        assert refused.status == 401, path
        assert refused.headers["X-Lifeguard-Reason"] == "unauthorized"
        assert (await stack.client.get(path, headers={"X-Lifeguard-Token": "wrong"})).status == 403, path
        assert (await stack.client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})).status == 200, path


def test_the_token_does_not_show_in_the_settings_repr() -> None:
    settings = Settings(upstream="http://127.0.0.1:1", admin_token=SecretStr(TOKEN))
    assert TOKEN not in repr(settings) and TOKEN not in str(settings)
    assert TOKEN not in settings.model_dump_json()


# ----- an echo upstream: what vLLM receives, exactly
class Echo:
    def __init__(self) -> None:
        self.seen: list[tuple[str, list[tuple[str, str]]]] = []

    def app(self) -> web.Application:
        app = web.Application()

        async def flags(request: web.Request) -> web.Response:
            name = request.path.strip("/")
            return web.json_response({name: False})

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200)

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="", content_type="text/plain")

        async def echo(request: web.Request) -> web.Response:
            self.seen.append((request.path, list(request.headers.items())))
            return web.json_response(
                {"choices": [{"text": "ok"}]},
                headers={"Keep-Alive": "timeout=5", "Proxy-Authenticate": "Basic", "X-Upstream": "yes"},
            )

        app.router.add_get("/health", health)
        app.router.add_get("/is_sleeping", flags)
        app.router.add_get("/is_paused", flags)
        app.router.add_get("/metrics", metrics)
        app.router.add_route("*", "/{tail:.*}", echo)
        return app

    def headers_for(self, path: str) -> dict[str, str]:
        matches = [dict((k.lower(), v) for k, v in h) for p, h in self.seen if p == path]
        assert matches, f"the upstream never saw {path}: {[p for p, _ in self.seen]}"
        return matches[-1]


async def _echo_stack(aiohttp_server: Any, serve_lifeguard: Any, **overrides: Any) -> tuple[TestClient[Any, Any], Echo]:
    echo = Echo()
    server: TestServer = await aiohttp_server(echo.app())
    settings = Settings(upstream=str(server.make_url("")).rstrip("/"), gpu_probe="none", canary_enabled=False,
                        reconcile_interval_s=0.2, **overrides)  # fmt: skip
    client: TestClient[Any, Any] = await serve_lifeguard(settings)
    deadline = time.monotonic() + 5
    token = overrides.get("admin_token")
    headers = {"X-Lifeguard-Token": token} if token else {}
    while (await (await client.get("/lifeguard/state", headers=headers)).json())["state"] != "RUNNING":
        assert time.monotonic() < deadline, "the proxy never reached RUNNING"
        await asyncio.sleep(0.01)
    return client, echo


async def test_inference_authorization_reaches_vllm_untouched(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    client, echo = await _echo_stack(aiohttp_server, serve_lifeguard, admin_token=TOKEN)
    resp = await client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {INFERENCE_KEY}"}
    )
    assert resp.status == 200
    assert echo.headers_for("/v1/completions")["authorization"] == f"Bearer {INFERENCE_KEY}"


async def test_hop_by_hop_headers_are_stripped_both_ways(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    client, echo = await _echo_stack(aiohttp_server, serve_lifeguard)
    sent = {
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Trailer": "X-Checksum",
        "Proxy-Authorization": "Basic Zm9vOmJhcg==",
        "X-Session-ID": "kept",
        "X-data-parallel-rank": "3",
    }
    resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=sent)
    assert resp.status == 200
    seen = echo.headers_for("/v1/completions")
    for name in ("x-drop-me", "keep-alive", "te", "trailer", "proxy-authorization"):
        assert name not in seen, f"{name} reached vLLM"
    assert seen["x-session-id"] == "kept" and seen["x-data-parallel-rank"] == "3"
    assert "Proxy-Authenticate" not in resp.headers and "Keep-Alive" not in resp.headers
    assert resp.headers["X-Upstream"] == "yes"


async def test_nothing_is_added_on_the_way_to_vllm(aiohttp_server: Any, serve_lifeguard: Any) -> None:
    client, echo = await _echo_stack(aiohttp_server, serve_lifeguard)
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 200
    seen = echo.headers_for("/v1/completions")
    for name in ("x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "forwarded", "via", "x-real-ip"):
        assert name not in seen, f"the proxy added {name}"


async def test_no_token_reaches_the_logs(make_stack: Callable[..., Awaitable[Stack]],
                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    stack = await make_stack(admin_token=TOKEN)
    await stack.client.post("/sleep", params={"level": "1"}, headers={"Authorization": f"Bearer {TOKEN}"})
    await stack.client.post("/wake_up", headers={"X-Lifeguard-Token": TOKEN})
    await stack.client.post("/pause", headers={"Authorization": f"Bearer {TOKEN}x"})
    await stack.client.post("/resume", headers={"X-Lifeguard-Token": "wrong-" + TOKEN})
    await stack.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        headers={"Authorization": f"Bearer {INFERENCE_KEY}"},
    )
    state = await (await stack.client.get("/lifeguard/state")).text()
    metrics = await (await stack.client.get("/lifeguard/metrics")).text()
    assert caplog.records, "nothing was logged at all: the check would prove nothing"
    for secret in (TOKEN, INFERENCE_KEY):
        assert secret not in caplog.text
        assert secret not in state and secret not in metrics


@pytest.mark.parametrize("header", ["Authorization", "X-Lifeguard-Token"])
async def test_the_admin_token_is_never_forwarded_to_vllm(
    aiohttp_server: Any, serve_lifeguard: Any, header: str
) -> None:
    """The header that carried the admin token authorises the call here; vLLM never sees the token."""
    client, echo = await _echo_stack(aiohttp_server, serve_lifeguard, admin_token=TOKEN)
    value = f"Bearer {TOKEN}" if header == "Authorization" else TOKEN
    resp = await client.post("/abort_requests", json={}, headers={header: value, "X-Session-ID": "kept"})
    assert resp.status == 200
    seen = echo.headers_for("/abort_requests")
    assert header.lower() not in seen
    assert TOKEN not in repr(seen)
    assert seen["x-session-id"] == "kept"


# ----- no input value of a secret setting reaches any output: the secret-echo probe, `vllm-lifeguard` as a process
#: Every secret setting, found by its type: a secret added later is probed without a change here.
SECRET_SETTINGS = sorted(name for name, field in Settings.model_fields.items() if "SecretStr" in str(field.annotation))
PROBE = "Zq7Xk2Lm9Np4-probe-4f9aR8tW"


def pieces(secret: str, width: int = 8) -> set[str]:
    return {secret[start : start + width] for start in range(len(secret) - width + 1)}


def test_the_secret_settings_are_the_ones_the_probe_knows() -> None:
    assert SECRET_SETTINGS == ["admin_token", "upstream_api_key"]


ENGINES = '[{"name": "a", "upstream": "http://127.0.0.1:2"}]'
BOTH = "upstream: http://127.0.0.1:1\nengines:\n  - name: a\n    upstream: http://127.0.0.1:2\n"


def settings_error(kind: str, name: str, s: str) -> tuple[list[str], dict[str, str], str | None]:
    """Every kind of settings error around a secret `s` set in setting `name` (from the environment, from the file,
    or misspelled): the arguments, the variables, and the YAML file (or None)."""
    variable, upstream = f"LIFEGUARD_{name.upper()}", ["--upstream", "http://127.0.0.1:9"]
    return {
        "field": (upstream, {variable: s, "LIFEGUARD_HOLD_TIMEOUT_S": "-1"}, None),
        "model-level": (["--upstream", "http://127.0.0.1:1"], {variable: s, "LIFEGUARD_ENGINES": ENGINES}, None),
        "model-level-in-file": ([], {}, f"{BOTH}{name}: {s}\n"),
        "json": ([], {variable: s, "LIFEGUARD_ENGINES": "notjson{"}, None),
        "yaml": ([], {}, f'upstream: http://127.0.0.1:9\n{name}: "{s}\nport: [\n'),
        "yaml-on-its-line": ([], {}, f"upstream: http://127.0.0.1:9\n{name}: {s}: x\n"),
        "type": ([], {}, f"upstream: http://127.0.0.1:9\n{name}: [{s}]\n"),
        "type-mapping": ([], {}, f"upstream: http://127.0.0.1:9\n{name}: {{key: {s}}}\n"),
        "not-a-mapping": ([], {}, f"{name}:{s}\n"),
        "misspelled": (upstream, {f"{variable}S": s}, None),
    }[kind]


ERROR_KINDS = ("field", "model-level", "model-level-in-file", "json", "yaml", "yaml-on-its-line", "type",
               "type-mapping", "not-a-mapping", "misspelled")  # fmt: skip


async def run_probe(argv: list[str], env: dict[str, str], yaml_text: str | None, tmp_path: Path) -> tuple[int, str]:
    """`vllm-lifeguard serve ARGV` with `env` (and `--config` of `yaml_text`): its status and everything it printed."""
    if yaml_text is not None:
        (tmp_path / "probe.yaml").write_text(yaml_text)
        argv = [*argv, "--config", str(tmp_path / "probe.yaml")]
    return await run("serve", *argv, **env)


@pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
@pytest.mark.parametrize("name", SECRET_SETTINGS)
async def test_no_piece_of_a_secret_reaches_any_output_of_a_settings_error(
    name: str, kind: str, tmp_path: Path
) -> None:
    """Was: a model-level error printed pydantic's repr of the whole input, whose tail was the secret set last
    (`input_value={'upstream': 'http://127....ECRETTAIL-9f8e7d6c5b4a'}`): in a pod, that is `kubectl logs`."""
    status, said = await run_probe(*settings_error(kind, name, PROBE), tmp_path)
    assert status == 2, said
    leaked = sorted(piece for piece in pieces(PROBE) if piece in said)
    assert leaked == [], said
    assert "input_value=" not in said and "Traceback" not in said


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--upstream", "ftp://user:" + PROBE + "@127.0.0.1:9"], {}),
        ([], {"LIFEGUARD_UPSTREAM": "user:" + PROBE + "@127.0.0.1:9"}),
        ([], {"LIFEGUARD_ENGINES": json.dumps([{"name": "a", "upstream": f"ftp://u:{PROBE}@h:1", "gpu": [0]}])}),
        (
            ["--upstream", f"http://u:{PROBE}@127.0.0.1:1"],
            {"LIFEGUARD_ENGINES": '[{"name":"a","upstream":"http://h"}]'},
        ),
    ],
    ids=["bad-scheme-flag", "no-scheme-variable", "engines-json", "model-level"],
)
async def test_no_piece_of_a_password_in_an_upstream_url_reaches_a_settings_error(
    argv: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    status, said = await run_probe(argv, env, None, tmp_path)
    assert status == 2, said
    assert sorted(piece for piece in pieces(PROBE) if piece in said) == [], said


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_no_piece_of_a_secret_reaches_the_log_of_a_start_that_fails(level: str, tmp_path: Path) -> None:
    """After the settings are read: a port in use, logged (with the traceback at debug)."""
    async with port_in_use() as port:
        env = {f"LIFEGUARD_{name.upper()}": PROBE for name in SECRET_SETTINGS}
        argv = ["--upstream", f"http://user:{PROBE}@127.0.0.1:9", "--port", str(port), "--log-level", level]
        status, said = await run_probe(argv, env, None, tmp_path)
    assert status == 1 and f"cannot listen on 127.0.0.1:{port}" in said
    assert sorted(piece for piece in pieces(PROBE) if piece in said) == [], said


async def test_no_piece_of_an_upstream_password_reaches_the_log_or_the_state_of_an_engine_it_cannot_reach() -> None:
    """Was: `connection refused by user:<password>@127.0.0.1:PORT` in the engine's errors, /lifeguard/state's too."""

    async with serving(f"http://user:{PROBE}@127.0.0.1:{free_port()}") as (port, proc):
        warning = await line_with(proc, "WARNING")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            async with client.get(f"http://127.0.0.1:{port}/lifeguard/state") as state:
                said = warning + await state.text()
    assert "user:***@127.0.0.1" in said and "cannot be reached: connection refused by 127.0.0.1:" in said
    assert sorted(piece for piece in pieces(PROBE) if piece in said) == [], said
