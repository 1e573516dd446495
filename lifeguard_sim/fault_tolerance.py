"""vLLM 0.34's engine fault tolerance (`--enable-fault-tolerance`), for one engine: its status, the refusal of new
requests while it is not healthy, and recovery through `/v1/fault_tolerance/apply`.

Read in the 0.34 wheel:

* `v1/fault_tolerance/engine_core_sentinel.py`: when the busy loop raises, `EngineCoreSentinel.on_fault` aborts every
  request, reports the engine `diagnosing`, then `unhealthy` with `fault_info` (the exception's type name), and the
  loop waits up to `engine_recovery_timeout_sec` (120) for an instruction before the error is raised (the engine dies).
  `handle_command` takes `retry` or `scale_down` only while unhealthy (else "[FT] Rejecting <instruction> on engine 0:
  status is HEALTHY"); `scale_down` on a data-parallel size of 1 fails ("scale_down requires data_parallel_size > 1;
  a dp=1 engine has no ranks to remove"). Success marks the engine healthy.
* `v1/engine/core_client.py` (`AsyncMPClient.handle_fault`, `get_status`): the cached status entry per engine,
  `{"id": 0, "status": "healthy"}`; an apply sets `ft_state: "recovering"` and `last_ft_request_id`, a failure
  `ft_state: "failed"` and `ft_error`; a status push from the engine replaces the entry. A second apply while one
  recovers fails with "another recovery is in progress".
* `v1/engine/async_llm.py` (`check_admission`): while the status is not "healthy" a new request is refused with
  EngineFaultedError, 503, before a stream starts. `/health` reads only the dead flag: it stays 200.
* `serve/fault_tolerance/api_router.py`: the routes (`lifeguard_sim/routes_fault_tolerance.py`).

The busy loop also stops consuming other utility calls while it waits: the simulator holds lifecycle calls meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vllm/exceptions.py EngineFaultedError
FAULTED_MESSAGE = (
    "The engine has faulted and cannot accept new requests. Please try again later or on a different instance."
)
INSTRUCTIONS = frozenset({"retry", "scale_down"})  # v1/fault_tolerance/utils.py ALLOWED_FT_INSTRUCTIONS


@dataclass
class FaultTolerance:
    enabled: bool
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # The client's cached status entry of this engine (what GET /v1/fault_tolerance/status lists).
    entry: dict[str, object] = field(default_factory=lambda: {"id": 0, "status": "healthy"})
    dead_ranks: set[int] = field(default_factory=set)

    @property
    def status(self) -> str:
        return str(self.entry["status"])

    @property
    def refuses(self) -> bool:
        """check_admission: a new request is refused (only with fault tolerance on)."""
        return self.enabled and self.status != "healthy"

    @property
    def waiting(self) -> bool:
        """The busy loop waits for a recovery instruction (and takes no other utility call)."""
        return self.enabled and self.status == "unhealthy"

    def on_fault(self, exception_name: str) -> None:
        self.entry = {"id": 0, "status": "unhealthy", "fault_info": exception_name}

    def on_timeout(self) -> None:
        """No instruction came within engine_recovery_timeout_sec: the loop raises, the engine core dies."""
        self.entry = {"id": 0, "status": "dead"}

    def apply(self, instruction: str, params: dict[str, object], request_id: str) -> str | None:
        """One recovery round, as `handle_fault` and the sentinel run it: None when the engine is healthy again, else
        why it failed (recorded in the status entry)."""
        if self.entry.get("ft_state") == "recovering":
            return self._failed(request_id, "another recovery is in progress")
        self.entry = {**self.entry, "ft_state": "recovering", "last_ft_request_id": request_id}
        self.entry.pop("ft_error", None)
        reason = self._refusal(instruction, params)
        if reason is not None:
            return self._failed(request_id, reason)
        self.entry = {"id": 0, "status": "healthy"}  # _mark_healthy's push replaces the cached entry
        return None

    def _refusal(self, instruction: str, params: dict[str, object]) -> str | None:
        if self.status != "unhealthy":
            return f"[FT] Rejecting {instruction} on engine 0: status is {self.status.upper()}"
        if instruction == "retry":
            return None
        if self.data_parallel_size == 1:
            return "scale_down requires data_parallel_size > 1; a dp=1 engine has no ranks to remove"
        raw = params.get("removed_dp_ranks")
        removed = {r for r in raw if isinstance(r, int)} if isinstance(raw, list) else set()
        everyone = set(range(self.data_parallel_size))
        newly = removed - self.dead_ranks
        if (
            not removed
            or not removed <= everyone
            or self.data_parallel_rank in removed
            or everyone <= self.dead_ranks | newly
            or not newly
        ):
            return (
                f"Invalid removed_dp_ranks {sorted(removed)} for engine 0 (dp_rank={self.data_parallel_rank}, "
                f"dead_dp_ranks={sorted(self.dead_ranks)})"
            )
        self.dead_ranks |= newly
        return None

    def _failed(self, request_id: str, reason: str) -> str:
        self.entry = {**self.entry, "ft_state": "failed", "last_ft_request_id": request_id, "ft_error": reason}
        return reason

    def status_body(self) -> dict[str, object]:
        return {"schema_version": 1, "total_engines": 1, "engines": [dict(self.entry)]}
