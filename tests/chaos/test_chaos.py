"""`pytest -m chaos`: the bounded chaos runs as tests (the same runs `make chaos` does with --quick, and
`make chaos-engines`: two engines on one simulated GPU, `make chaos-pods`: three pods; docs/reliability.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = [sys.executable, "-m", "tests.chaos.chaos_run"]


@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_the_bounded_chaos_run_keeps_every_invariant() -> None:
    done = subprocess.run([*RUNNER, "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=230)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_the_bounded_two_engine_chaos_run_keeps_every_invariant() -> None:
    done = subprocess.run([*RUNNER, "--engines", "2", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=290)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.chaos
@pytest.mark.timeout(420)  # three proxies and three simulators on two cores: about 4 min
def test_the_bounded_three_pod_chaos_run_keeps_every_invariant() -> None:
    """`make chaos-pods`: three proxies (one per pod) on one simulated GPU and one gpu_lock_dir."""
    done = subprocess.run([*RUNNER, "--pods", "3", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=410)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
