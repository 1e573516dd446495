"""vLLM 0.34's process-checkpoint lifecycle, engine side: its state and what each state refuses.

Read in the 0.34 wheel: `CheckpointState` (`vllm/v1/engine/__init__.py`) is RUNNING, PREPARING, PREPARED, RESTORING
or FAILED; `EngineCoreProc.checkpoint_prepare(mode)` (`vllm/v1/engine/core.py`) refuses unless RUNNING with sleep mode
and an awake executor, then drains with `pause_generation(mode, clear_cache=False)` (so abort and wait refuse new
requests with `engine_paused`, keep queues them); once drained `_finish_pause` runs `release_kv_cache_memory()` (the
caches, the KV connector's included, reset; the KV cache discarded) and the workers' `checkpoint_prepare` (the
device communicators), and the state is PREPARED, or FAILED with the error. `checkpoint_restore()` is a no-op unless
PREPARED, then RESTORING: the workers' `checkpoint_restore` and `wake_up(["kv_cache"])`, whose `resume_scheduler`
makes it RUNNING; a failure is FAILED and raised. `sleep` needs RUNNING, `wake_up` and `resume_scheduler` need
RUNNING or RESTORING, each raising `RuntimeError("Cannot <do> while the checkpoint state is <state>")`. Nothing
leaves FAILED but a restart. The HTTP side is `lifeguard_sim/routes_checkpoint.py`.
"""

from __future__ import annotations

from enum import StrEnum


class CheckpointState(StrEnum):
    RUNNING = "running"
    PREPARING = "preparing"
    PREPARED = "prepared"
    RESTORING = "restoring"
    FAILED = "failed"

    @property
    def is_restored(self) -> bool:
        """Whether memory may wake and scheduling resume (vLLM's `CheckpointState.is_restored`)."""
        return self in (CheckpointState.RUNNING, CheckpointState.RESTORING)


# What the engine core says when it refuses `prepare` (returned, not raised: the route answers 400 with it).
NEEDS_SLEEP_MODE = "Preparing for a checkpoint requires --enable-sleep-mode"
NEEDS_AWAKE = "Preparing for a checkpoint requires an awake engine"


class Checkpoint:
    def __init__(self) -> None:
        self.state = CheckpointState.RUNNING
        self.error: str | None = None

    def fail(self, error: str) -> None:
        """`EngineCore._fail_checkpoint`."""
        self.state = CheckpointState.FAILED
        self.error = error

    def refusal(self, action: str) -> str | None:
        """Why `action` (sleep, wake up, resume scheduling) is refused in this state, or None."""
        allowed = self.state is CheckpointState.RUNNING if action == "sleep" else self.state.is_restored
        return None if allowed else f"Cannot {action} while the checkpoint state is {self.state}"

    def body(self) -> dict[str, object]:
        """`CheckpointStateResponse`, dumped with exclude_none (serve/checkpoint/api_router.py)."""
        return {"state": str(self.state)} if self.error is None else {"state": str(self.state), "error": self.error}
