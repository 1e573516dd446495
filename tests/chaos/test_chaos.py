"""`pytest -m chaos`: the bounded chaos run as a test (the same run `make chaos` does with --quick).

The two-engine run (`make chaos-engines`) is left out: the arbiter bugs it found are fixed, but its
per-engine "every fault kind fired" invariant still fails on some runs (docs/reliability.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("chaos_run.py")


@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_the_bounded_chaos_run_keeps_every_invariant() -> None:
    done = subprocess.run([sys.executable, str(RUNNER), "--quick"], capture_output=True, text=True, timeout=230)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
