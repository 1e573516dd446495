"""The routes a vLLM release can serve, read from its source by an AST scan, and those proxy/front/route_table.py
misses.

    python scripts/vllm/route_scan.py WHEEL_OR_SITE_PACKAGES [--list]

No vLLM import, no GPU, nothing installed: the wheel is read as the zip it is (only `vllm/entrypoints/**.py`), so
the newest GPU wheel can be checked on a CPU-only CI machine (`make test-vllm-routes`). Found:

* decorators `@<any>.get/post/put/patch/delete/head/options/api_route("/path", methods=[...])` (routers and apps);
* calls `<any>.add_api_route("/path", ..., methods=[...])`;
* mounts `Mount("/path", ...)` and `<any>.mount("/path", ...)` (every method, like starlette);
* `APIRouter(prefix="/p")` assigned to a module-level name prefixes that router's routes.

A path that is not a string literal is resolved when it is one of FastAPI's own URL attributes
(`app.swagger_ui_oauth2_redirect_url`, ...) and otherwise reported as dynamic (scale_out's 403 stand-ins re-add
routes found elsewhere under their own `route.path`). Exit status 1 when a route is not classified, 2 on bad input.
`make test-vllm` checks this scan against the app vLLM 0.32 itself builds (tests/vllm/test_vllm_routes.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_METHOD_DECORATORS = {
    "get": ("GET",),
    "post": ("POST",),
    "put": ("PUT",),
    "patch": ("PATCH",),
    "delete": ("DELETE",),
    "head": ("HEAD",),
    "options": ("OPTIONS",),
}
# FastAPI's defaults for the URL attributes vLLM passes instead of a literal.
_FASTAPI_URLS = {
    "swagger_ui_oauth2_redirect_url": "/docs/oauth2-redirect",
    "openapi_url": "/openapi.json",
    "docs_url": "/docs",
    "redoc_url": "/redoc",
}
ENTRYPOINTS = "vllm/entrypoints/"


@dataclass(frozen=True)
class ScannedRoute:
    method: str  # "*" for a mount
    path: str
    where: str  # file:line

    def as_dict(self) -> dict[str, str]:
        return {"method": self.method, "path": self.path, "where": self.where}


@dataclass(frozen=True)
class Dynamic:
    """A route whose path is an expression the scan cannot read."""

    expression: str
    where: str


def scan_source(name: str, source: str) -> tuple[list[ScannedRoute], list[Dynamic]]:
    """The routes one module declares, and those whose path is not a literal."""
    tree = ast.parse(source, filename=name)
    prefixes = _router_prefixes(tree)
    routes: list[ScannedRoute] = []
    dynamic: list[Dynamic] = []

    def add(owner: ast.expr, path_node: ast.expr | None, methods: Iterable[str], node: ast.AST) -> None:
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        path = _literal_path(path_node)
        if path is None:
            dynamic.append(Dynamic(ast.unparse(path_node) if path_node is not None else "<none>", where))
            return
        prefix = prefixes.get(owner.id, "") if isinstance(owner, ast.Name) else ""
        routes.extend(ScannedRoute(method, prefix + path, where) for method in methods)

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                    continue
                attr = decorator.func.attr
                if attr in _METHOD_DECORATORS:
                    add(decorator.func.value, _first_arg(decorator), _METHOD_DECORATORS[attr], decorator)
                elif attr == "api_route":
                    add(decorator.func.value, _first_arg(decorator), _methods_kw(decorator) or ("GET",), decorator)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "add_api_route":
                add(func.value, _first_arg(node), _methods_kw(node) or ("GET",), node)
            elif isinstance(func, ast.Attribute) and func.attr == "mount":
                add(func.value, _first_arg(node), ("*",), node)
            elif isinstance(func, ast.Name) and func.id == "Mount":
                add(func, _first_arg(node), ("*",), node)
    return routes, dynamic


def _router_prefixes(tree: ast.Module) -> dict[str, str]:
    found: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        if not (isinstance(call.func, ast.Name) and call.func.id == "APIRouter"):
            continue
        prefix = next((k.value for k in call.keywords if k.arg == "prefix"), None)
        if isinstance(prefix, ast.Constant) and isinstance(prefix.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = prefix.value
    return found


def _first_arg(call: ast.Call) -> ast.expr | None:
    if call.args:
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == "path"), None)


def _literal_path(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/"):
        return node.value
    if isinstance(node, ast.Attribute) and node.attr in _FASTAPI_URLS:
        return _FASTAPI_URLS[node.attr]
    return None


def _methods_kw(call: ast.Call) -> tuple[str, ...]:
    for keyword in call.keywords:
        if keyword.arg == "methods" and isinstance(keyword.value, (ast.List, ast.Tuple, ast.Set)):
            return tuple(
                str(element.value).upper()
                for element in keyword.value.elts
                if isinstance(element, ast.Constant) and isinstance(element.value, str)
            )
    return ()


def entrypoint_sources(location: Path) -> Iterator[tuple[str, str]]:
    """(name, source) of every `vllm/entrypoints/**.py` in a wheel, or under a site-packages folder."""
    if location.is_file():
        with zipfile.ZipFile(location) as wheel:
            for name in sorted(wheel.namelist()):
                if name.startswith(ENTRYPOINTS) and name.endswith(".py"):
                    yield name, wheel.read(name).decode("utf-8")
        return
    root = location / ENTRYPOINTS
    if not root.is_dir():
        raise FileNotFoundError(f"{location} holds no {ENTRYPOINTS}")
    for path in sorted(root.rglob("*.py")):
        yield str(path.relative_to(location)), path.read_text("utf-8")


def scan(location: Path) -> tuple[list[ScannedRoute], list[Dynamic]]:
    routes: list[ScannedRoute] = []
    dynamic: list[Dynamic] = []
    for name, source in entrypoint_sources(location):
        found, unread = scan_source(name, source)
        routes.extend(found)
        dynamic.extend(unread)
    if not routes:
        raise FileNotFoundError(f"no routes found in {location}")
    # FastAPI serves its own documentation routes unless told not to; vLLM's app keeps them.
    routes.extend(ScannedRoute("GET", path, "fastapi default") for path in _FASTAPI_URLS.values())
    return routes, dynamic


def unclassified(routes: Iterable[ScannedRoute]) -> list[ScannedRoute]:
    """Routes the proxy's table (proxy/front/route_table.py) has no explicit entry for: each must be classified
    on purpose."""
    from proxy.front.route_table import build_table

    table = build_table()
    missing: list[ScannedRoute] = []
    for route in routes:
        # A template is looked up as written (`{name}` matches a segment) and with its name as the id.
        concrete = route.path.replace("{", "").replace("}", "")
        method = "GET" if route.method == "*" else route.method
        if table.lookup(method, route.path) is None and table.lookup(method, concrete) is None:
            missing.append(route)
    return missing


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("location", type=Path, help="a vLLM wheel, or a site-packages folder holding vllm/")
    parser.add_argument("--list", action="store_true", help="print every route found, as JSON lines")
    args = parser.parse_args(argv)
    try:
        routes, dynamic = scan(args.location)
    except (OSError, zipfile.BadZipFile, SyntaxError, UnicodeDecodeError) as exc:
        print(f"route scan: cannot read {args.location}: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for route in routes:
            print(json.dumps(route.as_dict()))
    distinct = sorted({(r.method, r.path) for r in routes})
    print(f"route scan of {args.location.name}: {len(distinct)} (method, path) pairs", file=sys.stderr)
    for item in dynamic:
        print(f"  not a literal path (not checked): {item.expression} at {item.where}", file=sys.stderr)
    missing = unclassified(routes)
    if missing:
        print("routes proxy/front/route_table.py does not classify:", file=sys.stderr)
        for route in missing:
            print(f"  {route.method} {route.path}  ({route.where})", file=sys.stderr)
        return 1
    print("every route is classified by proxy/front/route_table.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main(sys.argv[1:]))
