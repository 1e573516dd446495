"""sharing/host_memory.py: what a level-1 sleep would pin, set against the host memory available."""

from __future__ import annotations

from pathlib import Path

from proxy.sharing.host_memory import GIB, HostEngine, SleepChoice, choices, keeps_backups, mem_available


def _engine(name: str, **facts: object) -> HostEngine:
    values: dict[str, object] = {
        "weights_bytes": 16 * GIB,
        "sleep_level": 1,
        "fallback_to_level_2": False,
        "asleep_at_level_1": False,
        "backup_kept": False,
        **facts,
    }
    return HostEngine(name, **values)  # type: ignore[arg-type]


def test_a_budget_is_what_the_backups_counted_as_pinned_leave() -> None:
    engines = [_engine("a"), _engine("b", asleep_at_level_1=True), _engine("c", fallback_to_level_2=True)]
    got = choices(engines, 24 * GIB)
    assert got["a"] == SleepChoice(1, "its level-1 sleep would pin 16.00 GiB of host memory, 8.00 GiB is available")
    assert got["c"].level == 2 and got["c"].short is not None
    assert choices(engines, 32 * GIB)["a"] == SleepChoice(1)


def test_a_backup_kept_after_the_wake_pins_nothing_new_and_counts_as_held() -> None:
    kept = _engine("a", backup_kept=True)
    assert choices([kept, _engine("b")], 20 * GIB) == {
        "a": SleepChoice(1),
        "b": SleepChoice(1, "its level-1 sleep would pin 16.00 GiB of host memory, 4.00 GiB is available"),
    }


def test_level_2_and_unknown_sizes_are_not_held_back() -> None:
    got = choices([_engine("a", sleep_level=2), _engine("b", weights_bytes=None)], GIB)
    assert got == {"a": SleepChoice(2), "b": SleepChoice(1)}


def test_without_a_budget_the_kernels_mem_available_is_read(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\nMemAvailable:   10485760 kB\n")
    assert mem_available(meminfo) == 10 * GIB
    assert choices([_engine("a")], None, meminfo)["a"].short == (
        "its level-1 sleep would pin 16.00 GiB of host memory, 10.00 GiB is available"
    )
    assert mem_available(tmp_path / "absent") is None
    assert choices([_engine("a")], None, tmp_path / "absent")["a"] == SleepChoice(1)  # not Linux: not counted


def test_vllm_keeps_the_backup_from_0_34_on() -> None:
    assert keeps_backups("0.34.0") and keeps_backups("0.35.1rc1") and keeps_backups("1.0.0")
    assert not keeps_backups("0.33.2") and not keeps_backups(None) and not keeps_backups("dev")
