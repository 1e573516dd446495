"""CI cannot go green hollow (tests/ci_rules.py, scripts/ci_summary.py): each way a test could vanish from CI or pass
as a pinned bug it is not turns a run red. Each case is a real pytest run, with the repository's own settings
(pyproject.toml) and the rules' plugin, on test files written here, recorded as `.ci/run` records a group, and
then judged by the summary that ends `.ci/run`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUMMARY = REPO / "scripts" / "ci_summary.py"

FAILING_UI_TEST = """
import pytest

@pytest.mark.ui
def test_the_status_page_shows_the_sleep():
    assert False, "a bug nobody sees"
"""
PASSING_TESTS = """
def test_plain():
    assert True
"""
PASSING_UI_TEST = """
import pytest

@pytest.mark.ui
def test_the_status_page_loads():
    assert True
"""
# A known bug, pinned as the rules want: it fails by the assertion that states the wanted behaviour.
ENGINE = """
import pytest

class Engine:
    def sleep(self):
        return "awake"  # the bug: a sleep that did nothing
"""
PINNED = (
    ENGINE
    + """
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the sleep does nothing")
def test_a_sleep_sleeps():
    assert Engine().sleep() == "asleep"
"""
)


def _group(record: Path, project: Path, number: int, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One group of `.ci/run`: a pytest run in `project` with the repository's settings and the rules' plugin,
    recorded (JUnit XML, what it collected and ran) in RECORD/NN."""
    folder = record / f"{number:02d}"
    folder.mkdir(parents=True)
    env = {**os.environ, "LIFEGUARD_CI_RECORD": str(folder), "PYTHONPATH": str(REPO / "tests")}
    settings = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(project), "-p", "ci_rules"]
    junit = ["-p", "no:cacheprovider", "--junitxml", str(folder / "pytest.xml")]
    command = [sys.executable, "-m", "pytest", *settings, *junit, "-q", *args]
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=60)
    (folder / "name").write_text(name)
    (folder / "kind").write_text("tests")
    (folder / "rc").write_text(str(done.returncode))
    return done


def _summary(record: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SUMMARY), str(record)], capture_output=True, text=True, timeout=30)


def _project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _ci(root: Path, files: dict[str, str]) -> tuple[list[subprocess.CompletedProcess[str]], str, int]:
    """`make test` (every folder, the markers of pyproject.toml's addopts left out) then `make test-ui` (-m ui
    tests/ui), as .ci/run runs them; the summary's output and exit status."""
    project = _project(root / "project", files)
    record = root / "record"
    runs = [_group(record, project, 1, "make test", "tests"), _group(record, project, 2, "make test-ui", "-m", "ui",
                                                                      "tests/ui")]  # fmt: skip
    summary = _summary(record)
    return runs, summary.stdout, summary.returncode


HOLLOW_XFAILS = {
    "non_strict": (
        '@pytest.mark.xfail(strict=False, raises=AssertionError, reason="the sleep does nothing")\n'
        'def test_a_sleep_sleeps():\n    assert Engine().sleep() == "asleep"\n',
        "a non-strict xfail",
    ),
    "without_raises": (
        '@pytest.mark.xfail(strict=True, reason="the sleep does nothing")\n'
        'def test_a_sleep_sleeps():\n    assert Engine().sleep() == "asleep"\n',
        "an xfail without raises=",
    ),
    "never_run": (
        '@pytest.mark.xfail(strict=True, raises=AssertionError, run=False, reason="the sleep does nothing")\n'
        'def test_a_sleep_sleeps():\n    assert Engine().sleep() == "asleep"\n',
        "an xfail with run=False",
    ),
    "xfail_called": (
        "def test_a_sleep_sleeps():\n"
        '    if Engine().sleep() != "asleep":\n        pytest.xfail("the sleep does nothing")\n',
        "pytest.xfail() called",
    ),
    # The example: the method the pinned test calls was renamed, and the test body now raises
    # AttributeError; strict alone, without raises=, counted that as the bug (still "1 xfailed").
    "body_broken": (
        '@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the sleep does nothing")\n'
        'def test_a_sleep_sleeps():\n    assert Engine().go_to_sleep() == "asleep"\n',
        "AttributeError: 'Engine' object has no attribute 'go_to_sleep'",
    ),
    # pyproject.toml's xfail_strict: a marker that does not say strict= is strict, and the day the bug is fixed
    # its test fails, so that the marker goes.
    "bug_fixed": (
        '@pytest.mark.xfail(raises=AssertionError, reason="the sleep does nothing")\n'
        'def test_a_sleep_sleeps():\n    assert Engine().sleep() == "awake"\n',
        "[XPASS(strict)] the sleep does nothing",
    ),
}


@pytest.fixture(scope="module")
def misplaced(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[subprocess.CompletedProcess[str]], str, int]:
    """A failing `ui` test left in tests/e2e, beside a plain test and a known bug pinned as the rules want."""
    files = {"tests/e2e/test_misplaced.py": PASSING_TESTS + FAILING_UI_TEST, "tests/e2e/test_bug.py": PINNED,
             "tests/ui/test_page.py": PASSING_UI_TEST}  # fmt: skip
    return _ci(tmp_path_factory.mktemp("misplaced"), files)


@pytest.fixture(scope="module")
def hollow(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[subprocess.CompletedProcess[str]], str, int]:
    """Each hollow xfail in a file of its own, beside a known bug pinned as the rules want."""
    files = {f"tests/e2e/test_{case}.py": ENGINE + body for case, (body, _) in HOLLOW_XFAILS.items()}
    files |= {"tests/e2e/test_bug.py": PINNED, "tests/ui/test_page.py": PASSING_UI_TEST}
    return _ci(tmp_path_factory.mktemp("hollow"), files)


def test_a_failing_ui_test_left_in_tests_e2e_is_run_by_no_group_and_ci_fails(
    misplaced: tuple[list[subprocess.CompletedProcess[str]], str, int],
) -> None:
    runs, summary, rc = misplaced
    assert [run.returncode for run in runs] == [0, 0], [run.stdout for run in runs]  # each group alone is green
    assert "1 passed, 2 deselected, 1 xfailed" in runs[0].stdout  # the pinned bug is no problem
    problems = [line for line in summary.splitlines() if line.startswith("CI FAILED")]
    wanted = "tests/e2e/test_misplaced.py::test_the_status_page_shows_the_sleep is run by no group"
    assert rc == 1 and len(problems) == 1 and wanted in problems[0], summary


@pytest.mark.parametrize("case", list(HOLLOW_XFAILS))
def test_an_xfail_that_pins_no_known_bug_fails_its_test_and_ci(
    hollow: tuple[list[subprocess.CompletedProcess[str]], str, int], case: str
) -> None:
    runs, summary, rc = hollow
    reported = "ERROR" if case == "never_run" else "FAILED"  # run=False reports in the set-up: an error there
    assert f"{reported} tests/e2e/test_{case}.py::test_a_sleep_sleeps" in runs[0].stdout, runs[0].stdout
    assert HOLLOW_XFAILS[case][1] in runs[0].stdout
    assert "5 failed, 1 deselected, 1 xfailed, 1 error" in runs[0].stdout
    assert rc == 1 and "CI FAILED: group 'make test' failed (exit 1)" in summary, summary
    row = next(line for line in summary.splitlines() if line.startswith("make test "))
    exit_status, ran, passed, failed = row.removeprefix("make test ").split()[:4]
    assert (exit_status, failed) == ("1", str(len(HOLLOW_XFAILS))), summary  # counted as failures, not xfails
