"""The CI scripts themselves, run on copies with stand-ins for what they call: `.ci/run` gives every group CI=true
whatever the environment said, and scripts/test-vllm.sh fails (it does not skip) when tests/conformance has no
tests to run against the real vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_group_of_ci_runs_with_ci_true_also_when_the_environment_says_ci_1(tmp_path: Path) -> None:
    """A machine's own CI=1 (GitHub Actions and most runners set CI=true, some 1) must not reach the groups: with
    it `lifeguard_testing.missing` skips where CI must fail."""
    shutil.copytree(REPO / ".ci", tmp_path / ".ci")
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "ci_summary.py", tmp_path / "scripts")
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    seen = tmp_path / "seen"
    (stand_ins / "make").write_text(f'#!/bin/sh\necho "$* CI=$CI" >> {seen}\n')
    (stand_ins / "make").chmod(0o755)
    env = {**os.environ, "CI": "1", "PATH": f"{stand_ins}:{os.environ['PATH']}"}
    env.pop("LIFEGUARD_CI_RECORD", None)
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    calls = seen.read_text().splitlines()
    assert len(calls) >= 10, (calls, done.stdout[-2000:])  # every group ran (the stand-in ran no tests: CI fails)
    assert all(call.endswith(" CI=true") for call in calls), calls
    assert done.returncode == 1 and "ran no tests" in done.stdout


def _test_vllm_copy(root: Path, conformance: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "test-vllm.sh", root / "scripts")
    (root / "tests" / "conformance").mkdir(parents=True)
    for name, text in conformance.items():
        (root / "tests" / "conformance" / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")}
    return subprocess.run(["bash", str(root / "scripts" / "test-vllm.sh")], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_test_vllm_fails_at_once_when_the_conformance_suite_has_no_tests(tmp_path: Path) -> None:
    done = _test_vllm_copy(tmp_path, {"api.py": "", "conftest.py": ""})
    assert done.returncode == 1
    assert "tests/conformance has no test_*.py: nothing to run against the real vLLM" in done.stderr
    assert "setup-vllm.sh" not in done.stderr  # before anything else


def test_with_conformance_tests_test_vllm_goes_on_to_set_up_vllm(tmp_path: Path) -> None:
    """The control: the same copy with a test file passes the check (and fails only later, at the vLLM set-up this
    copy lacks)."""
    done = _test_vllm_copy(tmp_path, {"test_pause_refusal.py": ""})
    assert "no test_*.py" not in done.stderr
    assert "setup-vllm.sh failed" in done.stderr
