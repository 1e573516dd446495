"""`vllm-lifeguard status`'s table (proxy/observe/status_cli.py), from both shapes of `/lifeguard/state`."""

from __future__ import annotations

import io
import time
from typing import Any

import pytest

from proxy.observe.status_cli import engines_in, main, render, state_url

GIB = 1 << 30
T0 = 1_800_000_000.0


def clock(at: float, millis: bool = False) -> str:
    text = time.strftime("%H:%M:%S", time.localtime(at))
    return f"{text}.{int(at * 1000) % 1000:03d}" if millis else text


def engine(state: str = "RUNNING", **facts: Any) -> dict[str, Any]:
    """One engine's snapshot, with the keys proxy/lifecycle/coordinator.py's snapshot() has."""
    base: dict[str, Any] = {
        "state": state,
        "since": T0 - 30,
        "sleep_level": None,
        "asleep_tags": [],
        "sleep_unconfirmed": False,
        "paused": False,
        "pause_mode": None,
        "weight_update_active": False,
        "weights_stale": False,
        "weights_stale_reason": None,
        "last_error": None,
        "recent_errors": [],
        "transitions": [{"from": "STARTING", "to": "RUNNING", "at": T0 - 30}],
        "history_since": T0 - 31,
        "drift_events": [],
        "read_at": T0,
        "held_requests": 0,
        "inflight_requests": 0,
        "lifecycle_busy": False,
        "last_verification": None,
        "gpu_memory": None,
        "upstream": "http://127.0.0.1:8000",
    }
    return {**base, **facts}


def lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


def test_one_engine_flat_shape_one_line_with_every_fact() -> None:
    verdict = {
        "passed": True,
        "at": T0 - 5,
        "seconds": 0.2,
        "checks": [
            {"name": "health", "result": "pass", "detail": "healthy"},
            {"name": "memory", "result": "unavailable", "detail": "NVML: not found"},
        ],
    }
    state = engine(
        "SLEEPING",
        sleep_level=1,
        asleep_tags=["kv_cache", "weights"],
        paused=True,
        pause_mode="keep",
        weights_stale=True,
        weights_stale_reason="restarted",
        held_requests=3,
        inflight_requests=1,
        last_verification=verdict,
        gpu_memory={"available": True, "devices": [{"gpu": "0", "used_bytes": 3 * GIB, "total_bytes": 80 * GIB}]},
        transitions=[
            {"from": "STARTING", "to": "RUNNING", "at": T0 - 30},
            {"from": "RUNNING", "to": "FALLING_ASLEEP", "at": T0 - 6.5},
            {"from": "FALLING_ASLEEP", "to": "SLEEPING", "at": T0 - 6.25},
        ],
    )
    text = render(state, transitions=2)
    table = lines(text)
    assert table[0] == ["ENGINE", "STATE", "FOR", "SLEEP", "PAUSED", "WEIGHTS", "HELD", "IN", "FLIGHT", "LAST",
                        "VERIFICATION"]  # fmt: skip
    assert table[1] == ["default", "SLEEPING", "30.0s", "L1", "kv_cache,weights", "keep", "stale:restarted", "3", "1",
                        "ok", clock(T0 - 5), "(n/a:", "memory)"]  # fmt: skip
    assert "GPU 0  3.0/80.0 GiB used" in text
    assert "swap queue" not in text  # one engine: there is none
    assert text.splitlines()[-3:] == [
        "recent transitions:",
        f"  {clock(T0 - 6.5, True)}  default  RUNNING -> FALLING_ASLEEP",
        f"  {clock(T0 - 6.25, True)}  default  FALLING_ASLEEP -> SLEEPING",
    ]


def test_several_engines_a_line_each_the_gpu_lock_and_the_swap_queue() -> None:
    failed = {
        "passed": False,
        "at": T0 - 2,
        "seconds": 10.0,
        "checks": [
            {"name": "flags", "result": "pass", "detail": "flags agree"},
            {"name": "memory", "result": "fail", "detail": "1.0 GiB freed, 30.0 expected"},
        ],
    }
    state = {
        "engines": {
            "policy": engine(lifecycle_busy=True, held_requests=2, last_verification=failed),
            "judge": engine(
                "WAKING",
                since=T0 - 1.5,
                sleep_level=1,
                asleep_tags=["kv_cache", "weights"],
                last_error={"reason": "insufficient_gpu_memory", "message": "no room", "at": T0 - 90},
            ),
        },  # fmt: skip
        "gpus": {
            "0": {
                "engines": ["policy", "judge"],
                "awake": ["policy"],
                "used_bytes": 52 * GIB,
                "total_bytes": 80 * GIB,
                "free_bytes": 28 * GIB,
            }
        },  # fmt: skip
        "gpu_reading": None,
        "footprint_bytes": {"policy": 50 * GIB, "judge": 50 * GIB},
        "swap_queue": [
            {"engine": "judge", "op": "wake_up", "gpus": [0], "running": True, "for_s": 1.5},
            {"engine": "policy", "op": "collective_rpc", "gpus": [0], "running": False, "for_s": 0.5},
        ],
    }
    text = render(state)
    by_engine = {row[0]: row for row in lines(text)[1:3]}
    assert by_engine["policy"][:2] == ["policy", "RUNNING"]
    assert text.splitlines()[1].endswith(f"FAILED {clock(T0 - 2)} memory: 1.0 GiB freed, 30.0 expected")
    assert by_engine["judge"][:5] == ["judge", "WAKING", "1.5s", "L1", "kv_cache,weights"]
    assert "GPU 0  52.0/80.0 GiB used  awake: policy  lock: judge (wake_up)" in text
    assert (
        "swap queue: judge wake_up on GPU 0 (holds its GPUs, 1.5s); policy collective_rpc on GPU 0 (waiting, 0.5s)"
        in text
    )
    assert f"  {clock(T0 - 90)}  judge  insufficient_gpu_memory: no room" in text


def test_the_one_engine_of_the_rewritten_front_is_read_from_engines_too() -> None:
    """After the one-front rewrite a single engine is `engines: {default: ...}` with its own fields also at the top,
    where its `gpus` is its list of GPU indices (the fleet's per-GPU view comes only with several engines)."""
    reading = {"available": True, "devices": [{"gpu": "0", "used_bytes": 3 * GIB, "total_bytes": 80 * GIB}]}
    flat = engine(name="default", gpus=[0], pinned=False, models=["tiny"], gpu_memory=reading)
    both = {**flat, "engines": {"default": flat}}
    assert engines_in(both) == {"default": flat}
    assert engines_in(flat) == {"default": flat}
    text = render(both)
    assert text.splitlines()[1].split()[:2] == ["default", "RUNNING"] and len(lines(text)) == 5
    assert "GPU 0  3.0/80.0 GiB used" in text and "swap queue" not in text


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:8080", "http://h:8080/lifeguard/state"),
        ("http://h:8080/", "http://h:8080/lifeguard/state"),
        ("http://h:8080/engines/judge", "http://h:8080/engines/judge/lifeguard/state"),
        ("http://h:8080/lifeguard/state", "http://h:8080/lifeguard/state"),
    ],
)
def test_the_url_is_the_proxy_s_base(url: str, expected: str) -> None:
    assert state_url(url) == expected


def test_a_proxy_that_cannot_be_reached_is_one_clear_line_and_exit_1(unused_tcp_port: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main([f"http://127.0.0.1:{unused_tcp_port}", "--timeout", "2"], out, err) == 1
    assert out.getvalue() == ""
    assert err.getvalue().startswith(f"vllm-lifeguard status: cannot reach http://127.0.0.1:{unused_tcp_port}/")


@pytest.mark.parametrize("argv", [["localhost:8080"], ["--interval", "0"], ["--token", "a", "--token-file", "b"]])
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2


def test_a_gpu_named_by_uuid_is_shown_by_its_name_and_an_unread_one_says_why() -> None:
    reading = {"available": True, "devices": [{"gpu": "GPU-5f1c", "used_bytes": 58 * GIB, "total_bytes": 80 * GIB}]}
    assert "\nGPU-5f1c  58.0/80.0 GiB used\n" in render(engine(gpu_memory=reading))
    unread = {"available": False, "unavailable_reason": "NVML: driver not loaded", "devices": []}
    assert "GPU  no reading for default (NVML: driver not loaded)" in render(engine(gpu_memory=unread))
