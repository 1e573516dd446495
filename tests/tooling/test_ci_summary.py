"""scripts/ci_summary.py, the end of `.ci/run`: a test that skipped in CI and passed in no group fails the run
(coverage gone), but only once every group ran; a run that stopped at a failed group names that group, not the
tests of the groups it never reached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ci_summary.py"


def _group(record: Path, number: int, name: str, rc: int, cases: str, kind: str = "tests") -> None:
    folder = record / f"{number:02d}"
    folder.mkdir(parents=True)
    (folder / "name").write_text(name)
    (folder / "kind").write_text(kind)
    (folder / "rc").write_text(str(rc))
    (folder / "junit.xml").write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")


SKIPPED_POD = (
    '<testcase classname="tests.image.test_pod" name="test_probes"><skipped message="run make test-image"/></testcase>'
)
PASSED_POD = '<testcase classname="tests.image.test_pod" name="test_probes"/>'
PASSED_UNIT = '<testcase classname="tests.unit.test_x" name="test_y"/>'


def _summary(record: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(record)], capture_output=True, text=True, timeout=30)


def test_a_skip_that_passed_in_no_group_fails_a_complete_run(tmp_path: Path) -> None:
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT + SKIPPED_POD)
    _group(tmp_path, 2, "make test-image", 0, "")
    done = _summary(tmp_path)
    assert done.returncode == 1
    assert "tests.image.test_pod::test_probes skipped and passed in no group: run make test-image" in done.stdout


def test_a_skip_passed_by_a_later_group_is_covered(tmp_path: Path) -> None:
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT + SKIPPED_POD)
    _group(tmp_path, 2, "make test-image", 0, PASSED_POD)
    done = _summary(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "CI FAILED" not in done.stdout


@pytest.mark.parametrize("failed_rc", [1, 2])
def test_a_run_stopped_by_a_failed_group_names_that_group_only(tmp_path: Path, failed_rc: int) -> None:
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT + SKIPPED_POD)
    _group(tmp_path, 2, "make chaos-pods", failed_rc, "", kind="script")
    done = _summary(tmp_path)
    assert done.returncode == 1
    failures = [line for line in done.stdout.splitlines() if line.startswith("CI FAILED")]
    assert failures == [f"CI FAILED: group 'make chaos-pods' failed (exit {failed_rc})"], done.stdout


def _listed(record: Path, number: int, collected: list[str], selected: list[str]) -> None:
    (record / f"{number:02d}" / "collected-1.txt").write_text("".join(f"{test}\n" for test in collected))
    (record / f"{number:02d}" / "selected-1.txt").write_text("".join(f"{test}\n" for test in selected))


UI_IN_E2E = "tests/e2e/test_page.py::test_ui"
PASSED_UI = '<testcase classname="tests.ui.test_a" name="test_b"/>'


def test_a_test_collected_by_a_group_and_run_by_none_fails_a_complete_run(tmp_path: Path) -> None:
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT)
    _listed(tmp_path, 1, ["tests/unit/test_x.py::test_y", UI_IN_E2E], ["tests/unit/test_x.py::test_y"])
    _group(tmp_path, 2, "make test-ui", 0, PASSED_UI)
    _listed(tmp_path, 2, ["tests/ui/test_a.py::test_b"], ["tests/ui/test_a.py::test_b"])
    done = _summary(tmp_path)
    assert done.returncode == 1
    assert f"CI FAILED: {UI_IN_E2E} is run by no group" in done.stdout


def test_a_test_one_group_leaves_out_and_another_runs_is_covered(tmp_path: Path) -> None:
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT)
    _listed(tmp_path, 1, ["tests/unit/test_x.py::test_y", UI_IN_E2E], ["tests/unit/test_x.py::test_y"])
    _group(tmp_path, 2, "make test-ui", 0, PASSED_UI)
    _listed(tmp_path, 2, [UI_IN_E2E], [UI_IN_E2E])
    done = _summary(tmp_path)
    assert done.returncode == 0, done.stdout


def test_a_run_stopped_by_a_failed_group_does_not_judge_what_ran_nowhere(tmp_path: Path) -> None:
    """The group that would have run it may be among those the failure stopped."""
    _group(tmp_path, 1, "make test", 0, PASSED_UNIT)
    _listed(tmp_path, 1, ["tests/unit/test_x.py::test_y", UI_IN_E2E], ["tests/unit/test_x.py::test_y"])
    _group(tmp_path, 2, "make test-ui", 1, PASSED_UI)
    done = _summary(tmp_path)
    assert [line for line in done.stdout.splitlines() if line.startswith("CI FAILED")] == [
        "CI FAILED: group 'make test-ui' failed (exit 1)"
    ]
