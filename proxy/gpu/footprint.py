"""`Footprint`: how much GPU memory one engine takes awake, the one place that knows it.

Three sources, strongest first: `footprint_gib` in the engine's settings; what its first verified wake from a
full sleep added to its GPUs' device totals (several engines: measured by the arbiter); the engine's own
memory reading while it was known awake (its verifier: the scale its memory checks compare against).
"""

from __future__ import annotations

from .readers import GpuReading

GIB = 1 << 30


class Footprint:
    def __init__(self, configured_gib: float | None = None) -> None:
        self.configured = int(configured_gib * GIB) if configured_gib is not None else None
        self.measured: int | None = None  # growth of the device totals on a wake from a full sleep
        self.awake_reading: int | None = None  # the engine's own reading while awake

    def note_awake(self, reading: GpuReading) -> None:
        """The engine's own reading while it is known awake: what its memory checks compare against."""
        if reading.available and reading.used_bytes > 0:
            self.awake_reading = reading.used_bytes

    def measured_growth(self, grown: int) -> None:
        if self.configured is None and self.measured is None and grown > 0:
            self.measured = grown

    def forget_measure(self) -> None:
        """An out-of-memory on a wake proves the measure wrong: the next plan is cautious."""
        self.measured = None

    @property
    def bytes(self) -> int | None:
        """What a wake from a full sleep adds to its GPUs, as well as it is known; None when not known."""
        return self.configured or self.measured or self.awake_reading

    @property
    def awake_scale(self) -> int | None:
        """What it holds awake on the scale of its own reading (set against what it holds now for a wake's need)."""
        return self.configured if self.configured is not None else self.awake_reading
