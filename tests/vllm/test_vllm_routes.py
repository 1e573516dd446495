"""The route table against the vLLM it guards: every route vLLM serves is classified on purpose, and vLLM's
own server (uvicorn + starlette) routes the bytes the proxy forwards to the handler the proxy thought.

A new vLLM release that adds a route fails `test_every_route_vllm_can_serve_is_classified`: it must be
classified in proxy/front/route_table.py, not slip through as an unknown route.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.front.route_table import RouteKind, build_table
from proxy.front.target import canonical_target
from tests.vllm.vllm_e2e import lg_state

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TABLE = build_table()


def _unclassified(routes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    missing = []
    for method, path in routes:
        concrete = path.replace("{", "").replace("}", "")  # a template is looked up with its name as the id
        if TABLE.lookup(method, concrete) is None and TABLE.lookup(method, path) is None:
            missing.append((method, path))
    return missing


def test_every_route_vllm_can_serve_is_classified(vllm_server: Any) -> None:
    """vLLM's own app, built with every task and every route-adding flag on (scripts/vllm/vllm_routes.py)."""
    out = subprocess.run(
        [os.environ["LIFEGUARD_VLLM_PYTHON"], str(REPO / "scripts/vllm/vllm_routes.py")],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    routes = [(r["method"], r["path"]) for r in map(json.loads, out.stdout.splitlines())]
    assert len(routes) > 60, out.stderr[-2000:]  # the listing itself works
    assert ("POST", "/sleep") in routes and ("POST", "/v1/load_lora_adapter") in routes
    assert not _unclassified(routes), (
        f"routes vLLM serves that proxy/front/route_table.py does not classify: {_unclassified(routes)}"
    )


# Routes vLLM's app gets from other packages, which an AST scan of vllm/entrypoints cannot see: SageMaker's adapter
# routes (model_hosting_container_standards) and prometheus-fastapi-instrumentator's GET /metrics (the scan sees
# vLLM's own /metrics mount).
_NOT_IN_VLLMS_SOURCE = {("POST", "/adapters"), ("DELETE", "/adapters/{adapter_name}"), ("GET", "/metrics")}


def test_the_route_scan_of_the_installed_vllm_finds_every_route_its_app_builds() -> None:
    """scripts/vllm/route_scan.py (what `make test-vllm-routes` runs on the newest wheel) against vLLM's own app:
    every route the app serves is found by reading the source, so a route the scan misses is not a blind spot."""
    python = os.environ["LIFEGUARD_VLLM_PYTHON"]
    built = subprocess.run(
        [python, str(REPO / "scripts/vllm/vllm_routes.py")], capture_output=True, text=True, timeout=180, check=True
    )
    app_routes = {(r["method"], r["path"]) for r in map(json.loads, built.stdout.splitlines()) if r["method"] != "HEAD"}
    site = subprocess.run(
        [python, "-c", "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    listed = subprocess.run(
        [sys.executable, str(REPO / "scripts/vllm/route_scan.py"), site, "--list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr  # and every scanned route is classified
    scanned = {(r["method"], r["path"]) for r in map(json.loads, listed.stdout.splitlines())}
    scanned |= {("GET", path) for method, path in scanned if method == "*"}
    missed = app_routes - scanned - _NOT_IN_VLLMS_SOURCE
    assert not missed, f"routes vLLM's app serves that the AST scan did not find: {sorted(missed)}"


async def test_every_route_in_the_running_vllms_openapi_is_classified(
    vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    async with session.get(vllm_server.url + "/openapi.json") as resp:
        spec = await resp.json()
    routes = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    assert ("POST", "/sleep") in routes  # dev mode is on: the lifecycle routes are in the spec
    assert not _unclassified(routes), f"unclassified routes in vLLM's /openapi.json: {_unclassified(routes)}"


async def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


async def test_vllm_routes_the_forwarded_bytes_to_the_handler_the_proxy_classified(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    """An encoded path is classified on its decoded form and forwarded as sent: starlette must decode it to the
    same route. Sent to vLLM directly and through the proxy, both answer the same."""
    for raw_path, expect_key in (
        ("/v1/%6dodels", "data"),
        ("/%76ersion", "version"),
        ("/is_%73leeping", "is_sleeping"),
    ):
        assert TABLE.classify("GET", canonical_target(raw_path).path) is RouteKind.NEVER_GATED
        request = f"GET {raw_path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        for url in (vllm_server.url, proxy.url):
            answer = await _raw(url, request)
            assert answer.startswith(b"HTTP/1.1 200"), (url, raw_path, answer[:300])
            assert expect_key in json.loads(answer.split(b"\r\n\r\n", 1)[1]), (url, raw_path)


async def test_a_dot_segment_vllm_would_not_route_is_refused_not_normalised(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    """vLLM itself does not resolve `/./sleep` (404); the proxy refuses it (400) rather than turning it into /sleep."""
    request = b"POST /./sleep HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    direct = await _raw(vllm_server.url, request)
    assert direct.startswith(b"HTTP/1.1 404"), direct[:200]
    through = await _raw(proxy.url, request)
    assert through.startswith(b"HTTP/1.1 400"), through[:300]
    async with session.get(vllm_server.url + "/is_sleeping") as resp:
        assert (await resp.json())["is_sleeping"] is False
    assert (await lg_state(session, proxy.url))["state"] == "RUNNING"


async def test_vllms_trailing_slash_redirect_points_at_the_proxy(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    async with session.get(vllm_server.url + "/v1/models/", allow_redirects=False) as direct:
        assert direct.status == 307 and direct.headers["Location"].startswith(vllm_server.url)
    async with session.get(proxy.url + "/v1/models/", allow_redirects=False) as through:
        assert through.status == 307
        assert through.headers["Location"] == "/v1/models"
    async with session.get(proxy.url + "/v1/models/") as followed:
        assert followed.status == 200 and (await followed.json())["data"]


async def test_vllms_own_400_shape_comes_back_for_a_bad_parameter(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    """vLLM's test_pause_resume.py::test_invalid_mode_preserves_state asserts status 400 and
    error.param == "query.mode"; the proxy answers it itself, in the same shape."""
    for url in (vllm_server.url, proxy.url):
        async with session.post(url + "/pause", params={"mode": "invalid"}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["error"]["param"] == "query.mode", (url, body)
            assert body["error"]["type"] == "Bad Request" and body["error"]["code"] == 400
        async with session.post(url + "/sleep", params={"level": "5"}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["error"]["param"] == "query.level", (url, body)
    async with session.get(vllm_server.url + "/is_paused") as resp:
        assert (await resp.json())["is_paused"] is False


async def test_a_vllm_4xx_to_a_lifecycle_call_reaches_the_client(
    vllm_server: Any, proxy: Any, session: aiohttp.ClientSession
) -> None:
    """`/update_weights` with an empty body: vLLM's own 400, not a retryable 503."""
    async with session.post(vllm_server.url + "/update_weights", data=b"") as direct:
        direct_status, direct_body = direct.status, await direct.read()
    async with session.post(proxy.url + "/update_weights", data=b"") as through:
        assert through.status == direct_status and 400 <= direct_status < 500, await through.text()
        assert await through.read() == direct_body
        assert "Retry-After" not in through.headers
