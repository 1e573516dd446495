"""`pytest -m chaos`: the bounded chaos runs as tests (the same runs `make chaos` does with --quick, and
`make chaos-engines`: two engines on one GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("chaos_run.py")


@pytest.mark.chaos
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "two-engines-one-gpu"])
def test_the_bounded_chaos_run_keeps_every_invariant(engines: int) -> None:
    command = [sys.executable, str(RUNNER), "--quick", "--engines", str(engines)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=230)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
