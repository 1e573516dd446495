"""The house's import directions (docs/architecture.md, "The folders"): every part of proxy/ imports only parts below
it, so no folder reaches up into the one that uses it, and the map in the docs is the folders there are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
ARCHITECTURE = PROXY.parent / "docs" / "architecture.md"

#: Lowest first. A part is a folder of proxy/ or a module at its top; it may import the parts of lower rows only.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(row)
    for row in (
        {"errors", "tasks", "gpu", "observe", "compiled"},
        {"config", "upstream"},
        {"lifecycle"},
        {"engine"},
        {"sharing"},
        {"front"},
        {"app", "check"},
        {"cli"},
        {"__main__", "__init__"},  # __init__ runs first of all: it imports `compiled` only
    )
)
FLOOR = {part: level for level, row in enumerate(LAYERS) for part in row}


def part_of(module: Path, root: Path = PROXY) -> str:
    relative = module.relative_to(root)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(module: Path, root: Path = PROXY) -> dict[str, int]:
    """The parts of proxy/ that `module` imports, each with the line of its first import."""
    package = module.relative_to(root.parent).with_suffix("").parts[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            names = [*base, *(node.module or "").split(".")] if node.module else base
            targets = [names] if node.module else [[*base, alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("proxy."):
            targets = [(node.module or "").split(".")]
        elif isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names if alias.name.startswith("proxy.")]
        else:
            continue
        for names in targets:
            if len(names) > 1 and names[0] == "proxy" and names[1] != "__init__":
                found.setdefault(names[1], node.lineno)
    return found


def violations(root: Path = PROXY) -> list[str]:
    broken = []
    for module in sorted(root.rglob("*.py")):
        mine = part_of(module, root)
        for part, line in imported_parts(module, root).items():
            if part != mine and part in FLOOR and FLOOR[part] >= FLOOR[mine]:
                where = module.relative_to(root.parent)
                broken.append(
                    f"{where}:{line} imports {part} (row {FLOOR[part]}), not below {mine} (row {FLOOR[mine]})"
                )
    return broken


def test_every_part_is_placed_in_one_row() -> None:
    parts = {part_of(module) for module in PROXY.rglob("*.py")} - {"__init__"}
    placed = set(FLOOR) - {"__init__"}
    assert parts == placed, f"unplaced: {sorted(parts - placed)}; gone: {sorted(placed - parts)}"


def test_no_part_imports_a_part_above_or_beside_it() -> None:
    assert violations() == []


def test_the_architecture_map_names_the_folders_there_are() -> None:
    folders = {path.name for path in PROXY.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    mapped = set(re.findall(r"^\| `proxy/(\w+)/` \|", ARCHITECTURE.read_text(), flags=re.M))
    assert mapped == folders


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The rule itself can fail: a module of lifecycle/ importing the front is named, with its line."""
    lifecycle = tmp_path / "proxy" / "lifecycle"
    lifecycle.mkdir(parents=True)
    (lifecycle / "bad.py").write_text("from __future__ import annotations\n\nfrom ..front.exchange import Forward\n")
    assert violations(tmp_path / "proxy") == [
        "proxy/lifecycle/bad.py:3 imports front (row 5), not below lifecycle (row 2)"
    ]
