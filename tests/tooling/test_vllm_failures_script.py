"""scripts/vllm/failures.py: the end of `make test-vllm` says why each test failed, from pytest's own JUnit XML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm" / "failures.py"


def test_each_failure_and_error_is_printed_with_its_message_and_traceback_end(tmp_path: Path) -> None:
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture went wrong')\n"
        "def test_fails():\n"
        "    frozen_at = 3\n"
        "    assert frozen_at == 4, 'the stream kept producing while paused'\n"
        "def test_errors(broken):\n"
        "    pass\n"
        "def test_passes():\n"
        "    pass\n"
    )
    xml = tmp_path / "junit.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_demo.py", "--junitxml", str(xml)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stdout

    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(xml), str(tmp_path / "absent.xml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--- failure: test_demo::test_fails" in out
    assert "the stream kept producing while paused" in out
    assert "| >       assert frozen_at == 4" in out  # the traceback's end, with the failing line
    assert "--- error: test_demo::test_errors" in out and "fixture went wrong" in out
    assert "test_passes" not in out
    assert "2 failure(s) above" in out


def test_nothing_is_printed_when_everything_passed(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite name="pytest"><testcase classname="t" name="ok"/></testsuite></testsuites>')
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(xml)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out == ""
