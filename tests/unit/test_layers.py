"""The house's import directions (docs/architecture.md, "The folders"): every part of proxy/ imports only parts below
it, so no folder reaches up into the one that uses it, and the map in the docs is the folders there are. Each folder's
`__init__.py` says what it may import (`May import:`) and what others may import of it (`Door:`): both are checked
here, and the front and the arbiter reach an engine only through `Engine` (proxy/lifecycle/engine.py)."""

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
    found: dict[str, int] = {}
    for part, _, line in imported_modules(module, root):
        found.setdefault(part, line)
    return found


def imported_modules(module: Path, root: Path = PROXY) -> list[tuple[str, str, int]]:
    """Each import of a part of proxy/ by `module`: the part, the module of it named (`__init__`: the package or a
    module at the top), and the line."""
    package = module.relative_to(root.parent).with_suffix("").parts[:-1]
    found: list[tuple[str, str, int]] = []
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
                found.append((names[1], names[2] if len(names) > 2 else "__init__", node.lineno))
    return found


def _prose(folder: Path, label: str, known: set[str]) -> set[str]:
    """The names `known` that the `label:` paragraph of the folder's `__init__.py` lists (what is in parentheses
    only explains)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    said = re.search(rf"^{label}: (.*?)(?=^\w[\w ]*: |\Z)", doc, flags=re.M | re.S)
    assert said is not None, f"{folder.name}/__init__.py says nothing under {label!r}"
    text = re.sub(r"\([^)]*\)", "", said.group(1))
    return set(re.findall(r"\w+", text)) & known


def may_import(folder: Path) -> set[str]:
    return _prose(folder, "May import", set(FLOOR))


def door(folder: Path) -> set[str]:
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    return _prose(folder, "Door", modules) | {"__init__"}


def prose_broken(root: Path = PROXY) -> list[str]:
    """Imports the folders' own words do not allow: a folder importing a part its `May import:` leaves out, or
    another part importing a module of a folder that is not in its `Door:`."""
    folders = {path.name: path for path in root.iterdir() if (path / "__init__.py").exists()}
    allowed = {name: may_import(path) for name, path in folders.items()}
    doors = {name: door(path) for name, path in folders.items()}
    broken = []
    for module in sorted(root.rglob("*.py")):
        mine = part_of(module, root)
        where = module.relative_to(root.parent)
        for part, name, line in imported_modules(module, root):
            if part == mine or part not in FLOOR:  # not a part: the package's own names (its version)
                continue
            if mine in allowed and part not in allowed[mine]:
                broken.append(f"{where}:{line} imports {part}, which {mine}/__init__.py does not say it may")
            if part in doors and name not in doors[part]:
                broken.append(f"{where}:{line} imports {part}.{name}, not a door of {part}/")
    return broken


#: What only `Engine` may touch: the front and the arbiter ask the engine, never these parts of it (the gate's counts
#: too: the arbiter reads them through `Engine`).
ENGINE_PARTS = frozenset({"coordinator", "record", "verifier", "policies", "gate"})


def engine_parts_reached(root: Path = PROXY) -> list[str]:
    reached = []
    for folder in ("front", "sharing"):
        for module in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(module.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
                    reached.append(f"{module.relative_to(root.parent)}:{node.lineno} reaches .{node.attr}")
    return reached


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
        "proxy/lifecycle/bad.py:3 imports front (row 4), not below lifecycle (row 2)"
    ]


def test_every_folder_imports_what_its_init_says_and_others_only_its_door() -> None:
    assert prose_broken() == []


def test_the_front_and_the_arbiter_reach_an_engine_only_through_engine() -> None:
    assert engine_parts_reached() == []


def test_the_prose_check_catches_a_door_passed_by(tmp_path: Path) -> None:
    """The front importing the coordinator (not a door of lifecycle/) and reaching an engine's record are named."""
    root = tmp_path / "proxy"
    for folder, said in (
        ("front", "May import: lifecycle.\nDoor: x."),
        ("lifecycle", "May import: nothing.\nDoor: engine."),
    ):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text(f'"""{folder}.\n\n{said}\n"""\n')
    (root / "lifecycle" / "engine.py").write_text("")
    (root / "lifecycle" / "coordinator.py").write_text("")
    (root / "front" / "bad.py").write_text(
        "from __future__ import annotations\n\nfrom ..lifecycle.coordinator import C\n\nC.record.view()\n"
    )
    assert prose_broken(root) == ["proxy/front/bad.py:3 imports lifecycle.coordinator, not a door of lifecycle/"]
    assert engine_parts_reached(root) == ["proxy/front/bad.py:5 reaches .record"]
