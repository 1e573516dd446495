"""The simulator's settings: one frozen object built once and handed to the app."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SimSettings:
    """Everything the simulator can be told. Times are seconds, sizes GiB."""

    model: str = "tiny"
    sleep_seconds: float = 0.05
    wake_seconds: float = 0.1
    token_seconds: float = 0.002
    faults: Sequence[str] = field(default_factory=tuple)
    gpu_file: Path | str | None = None
    weights_gib: float = 16
    kv_gib: float = 40
    overhead_gib: float = 2
    total_gib: float = 80
    seed: int = 0
    crash_exits_process: bool = False
    # False mimics vLLM started without --enable-sleep-mode: /sleep flips the flags but frees nothing.
    sleep_mode: bool = True
    # vLLM's API server notices a dead engine core and exits on a 5 s watchdog tick.
    watchdog_seconds: float = 5.0
    max_model_len: int = 16384
