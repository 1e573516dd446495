"""tests/README.md's one package rule: every folder of tests/ that holds Python is a package, and a test imports the
repository's code by its module name (`tests.e2e.conftest`, `benchmarks.verdicts`, `scripts.docs.facts`), never from a
file path: a module loaded by path is a second copy, with classes of its own, under a name nothing else can import."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: The ways code was loaded by path here before the rule. (tests/clients/stand_ins.py appends the trainers' site,
#: packages installed from PyPI, to sys.path: that is how third-party code is found, not a file of ours.)
BY_PATH = re.compile(
    r"spec_from_file_location|SourceFileLoader|run_path\(|sys\.path\.insert|sys\.path\[|syspath_prepend"
)


def _python_files() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def test_every_folder_of_tests_that_holds_python_is_a_package() -> None:
    folders = {path.parent for path in _python_files()}
    missing = sorted(str(folder.relative_to(ROOT)) for folder in folders if not (folder / "__init__.py").exists())
    assert not missing, f"folders of tests/ without an __init__.py (tests/README.md): {missing}"


def test_no_test_loads_code_by_path() -> None:
    here = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _python_files()
        if path != here
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BY_PATH.search(line)
    ]
    assert not found, "code loaded by path; import it by its module name (tests/README.md):\n" + "\n".join(found)


def test_the_unit_tests_stand_in_the_folders_of_the_code() -> None:
    """tests/unit/ mirrors proxy/: a folder of unit tests is named for the folder of proxy/ whose modules it tests."""
    code = {path.name for path in (ROOT / "proxy").iterdir() if (path / "__init__.py").exists()}
    unit = {path.name for path in (TESTS / "unit").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert unit <= code, f"folders of tests/unit/ with no folder of proxy/ to mirror: {sorted(unit - code)}"
