"""scripts/vllm/route_scan.py: the AST scan that reads a vLLM release's routes from its wheel (`make test-vllm-routes`).

The scan is checked against the app vLLM 0.32 builds itself in tests/vllm/test_vllm_routes.py; here against
sources written in each of the shapes vLLM uses, a wheel built on the spot, and bad input.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts.vllm import route_scan

ROUTER_MODULE = """
from fastapi import APIRouter
router = APIRouter()
prefixed = APIRouter(prefix="/v9")

@router.post("/v1/decisions", dependencies=[])
async def decide(request): ...

@router.get("/is_paused")
async def is_paused(request): ...

@router.api_route("/both", methods=["GET", "post"])
async def both(request): ...

@prefixed.get("/thing/{thing_id}")
async def thing(request): ...

router.add_api_route("/inference/v1/abort_requests", abort, methods=["POST"])

def attach(app):
    app.routes.append(Mount("/metrics", make_asgi_app()))
    app.mount("/static", StaticFiles(directory="x"), name="static")

    @app.get(app.swagger_ui_oauth2_redirect_url, include_in_schema=False)
    async def redirect(): ...

    for route in other.routes:
        app.add_api_route(route.path, disabled, methods=sorted(route.methods))
"""


def test_every_shape_of_route_declaration_is_found() -> None:
    routes, dynamic = route_scan.scan_source("vllm/entrypoints/x/api_router.py", ROUTER_MODULE)
    found = {(r.method, r.path) for r in routes}
    assert found == {
        ("POST", "/v1/decisions"),
        ("GET", "/is_paused"),
        ("GET", "/both"),
        ("POST", "/both"),
        ("GET", "/v9/thing/{thing_id}"),
        ("POST", "/inference/v1/abort_requests"),
        ("*", "/metrics"),
        ("*", "/static"),
        ("GET", "/docs/oauth2-redirect"),
    }
    assert [d.expression for d in dynamic] == ["route.path"]
    decisions = next(r for r in routes if r.path == "/v1/decisions")
    assert decisions.where == "vllm/entrypoints/x/api_router.py:6"


def test_a_wheel_is_read_without_extracting_it_and_only_its_entrypoints(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/entrypoints/openai/decisions/api_router.py", ROUTER_MODULE)
        archive.writestr("vllm/v1/engine/core.py", '@router.post("/not_an_http_route")\nasync def f(): ...\n')
    routes, _ = route_scan.scan(wheel)
    paths = {r.path for r in routes}
    assert "/v1/decisions" in paths and "/not_an_http_route" not in paths
    assert {"/openapi.json", "/docs", "/redoc"} <= paths  # FastAPI's own, always served


def test_a_route_the_table_does_not_classify_is_reported_and_the_known_ones_are_not() -> None:
    routes, _ = route_scan.scan_source(
        "m.py",
        '@router.post("/v1/decisions")\nasync def a(): ...\n'
        '@router.post("/sleep")\nasync def b(): ...\n'
        '@router.get("/v1/responses/{response_id}")\nasync def c(): ...\n'
        '@router.post("/v1/brand_new_route")\nasync def d(): ...\n',
    )
    assert [(r.method, r.path) for r in route_scan.unclassified(routes)] == [("POST", "/v1/brand_new_route")]


def test_the_cli_fails_on_an_unclassified_route_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site-packages"
    (site / "vllm" / "entrypoints" / "serve").mkdir(parents=True)
    (site / "vllm" / "entrypoints" / "serve" / "api_router.py").write_text(
        '@router.post("/sleep")\nasync def a(): ...\n@router.post("/v1/brand_new_route")\nasync def d(): ...\n'
    )
    assert route_scan.main([str(site)]) == 1
    err = capsys.readouterr().err
    assert "POST /v1/brand_new_route" in err and "vllm/entrypoints/serve/api_router.py:3" in err


@pytest.mark.parametrize("content", [None, b"not a zip", b""])
def test_a_missing_or_broken_wheel_is_exit_2_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None
) -> None:
    target = tmp_path / "vllm.whl"
    if content is not None:
        target.write_bytes(content)
    assert route_scan.main([str(target)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_wheel_with_no_routes_is_exit_2_not_a_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = tmp_path / "vllm.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/entrypoints/__init__.py", "")
    assert route_scan.main([str(wheel)]) == 2
    assert "no routes found" in capsys.readouterr().err
