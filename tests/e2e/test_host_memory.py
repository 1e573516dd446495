"""Host memory in the swap planner's books (docs/model-swap.md, rule 10): vLLM 0.34 keeps a level-1 sleep's CPU backup
of the weights pinned after the wake, so engines swapped on one GPU each pin about their weights' size of host memory.
The simulators' 0.34 profile keeps the backups and reports them (`host_bytes`); the proxy's budget here stands for the
node's memory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tests.e2e.conftest import GIB, EnginesStack

MakeEngines = Callable[..., Awaitable[EnginesStack]]
V034 = {"a": {"vllm_version": "0.34"}, "b": {"vllm_version": "0.34"}}
# b asleep at level 1 pins its 16 GiB of weights; a's level-1 sleep would pin 16 more of the 24 there are.
BUDGET = {"host_backup_budget_gib": 24}


def _host_bytes(stack: EnginesStack) -> dict[str, int]:
    return {name: int(stack.sim(name).state_dict()["memory"]["host_bytes"]) for name in stack.sims}  # type: ignore[index]


async def test_a_level_1_swap_that_would_pin_more_host_memory_than_there_is_is_refused(
    make_engines: MakeEngines,
) -> None:
    weights = {"weights_gib": 16}
    stack = await make_engines(sim=V034, engine={"a": weights, "b": weights}, **BUDGET)
    assert _host_bytes(stack) == {"a": 0, "b": 16 * GIB}
    resp = await stack.completion("model-b")
    assert resp.status == 503
    body = await resp.json()
    assert body["error"]["reason"] == "insufficient_gpu_memory"
    assert "would pin 16.00 GiB of host memory, 8.00 GiB is available" in body["error"]["message"]
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    host = (await stack.state())["host_memory"]
    assert (host["budget_bytes"], host["available_bytes"], host["backups_kept"]) == (24 * GIB, 8 * GIB, [])
    assert stack.sim_count("a", "sleep") == 0
    assert sum(_host_bytes(stack).values()) <= 24 * GIB
    assert stack.violations() == {}


async def test_an_engine_allowed_level_2_is_put_to_sleep_so_and_reloaded_at_its_wake(make_engines: MakeEngines) -> None:
    stack = await make_engines(
        sim=V034,
        engine={"a": {"weights_gib": 16, "when_host_memory_short": "level_2"}, "b": {"weights_gib": 16}},
        **BUDGET,
    )
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    state = await stack.state()
    assert state["engines"]["a"]["state"] == "SLEEPING" and state["engines"]["a"]["sleep_level"] == 2
    assert _host_bytes(stack) == {"a": 0, "b": 16 * GIB}  # b's backup kept after its wake, a's never made
    # Back: b's level-1 sleep reuses the backup it kept; a is woken and its weights reloaded before it serves.
    resp = await stack.completion("model-a")
    assert resp.status == 200, await resp.text()
    assert await stack.states() == {"a": "RUNNING", "b": "SLEEPING"}
    assert stack.sim_count("a", "collective_rpc") == 1
    assert _host_bytes(stack) == {"a": 0, "b": 16 * GIB}
    assert stack.violations() == {}


async def test_without_the_setting_a_level_1_swap_goes_on_as_before(make_engines: MakeEngines) -> None:
    """No budget: the kernel's MemAvailable, above the simulated backups of 1 GiB each here."""
    small = {"vllm_version": "0.34", "weights_gib": 1}
    stack = await make_engines(sim={"a": small, "b": small}, engine={"a": {"weights_gib": 1}})
    resp = await stack.completion("model-b")
    assert resp.status == 200, await resp.text()
    state: dict[str, Any] = await stack.state()
    assert state["engines"]["a"]["sleep_level"] == 1
    assert _host_bytes(stack) == {"a": GIB, "b": GIB}
    assert state["host_memory"]["backups_kept"] == ["a"]  # on 0.34 a's backup stays pinned once it wakes
    assert state["host_memory"]["available_bytes"] > 0  # MemAvailable
