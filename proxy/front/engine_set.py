"""`EngineSet`: every engine of one proxy and what stands above them (the arbiter, the model directory, the
router, the metrics), as the front and the proxy's own routes see them. Built by proxy/app.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Settings
from ..lifecycle.engine import Engine
from ..observe.metrics import Metrics
from ..sharing.arbiter import Arbiter
from ..tasks import Tasks
from .model_directory import ModelDirectory
from .routing import Router


@dataclass
class EngineSet:
    settings: Settings
    engines: dict[str, Engine]
    arbiter: Arbiter | None  # several engines, or gpu_lock_dir: who may wake where (proxy/sharing/arbiter.py)
    directory: ModelDirectory
    router: Router
    metrics: Metrics
    # Requests the proxy answers itself run as these tasks; cancelled when it stops.
    tasks: Tasks = field(default_factory=Tasks)
