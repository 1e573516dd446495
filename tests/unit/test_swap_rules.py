"""Memory admission for a wake on shared GPUs (proxy/swap_rules.py), no I/O."""

from __future__ import annotations

from dataclasses import replace

from proxy.gpu import DeviceMemory, GpuReading
from proxy.swap_rules import GIB, Evict, Fits, Neighbour, NoRoom, eviction_order, free_per_gpu, plan_room

IDLE = Neighbour(
    name="x", gpus=(0,), awake=True, pinned=False, busy=False, inflight=0, held=0, last_used=0.0, footprint_bytes=None
)


def _n(name: str, **changes: object) -> Neighbour:
    return replace(IDLE, name=name, **changes)  # type: ignore[arg-type]


def test_free_memory_per_gpu_by_device_index() -> None:
    reading = GpuReading(devices=(DeviceMemory("a", 10 * GIB, 80 * GIB), DeviceMemory("b", 70 * GIB, 80 * GIB)))
    assert free_per_gpu(reading, (0, 1)) == {0: 70 * GIB, 1: 10 * GIB}
    assert free_per_gpu(reading, (2,)) is None  # a GPU the reader does not see: cannot say
    assert free_per_gpu(GpuReading(unavailable="no NVML"), (0,)) is None


def test_least_recently_used_first_and_never_pinned_busy_held_or_elsewhere() -> None:
    neighbours = [
        _n("recent", last_used=9.0),
        _n("old", last_used=1.0),
        _n("pinned", pinned=True),
        _n("busy", busy=True),
        _n("holding", held=2),
        _n("asleep", awake=False),
        _n("other-gpu", gpus=(1,)),
        _n("serving", inflight=1),
    ]
    assert [n.name for n in eviction_order((0,), neighbours, may_drain=False)] == ["old", "recent"]
    # With a drain before the sleep, an engine with requests in flight may go too, but after the idle ones.
    assert [n.name for n in eviction_order((0,), neighbours, may_drain=True)] == ["old", "recent", "serving"]


def test_it_fits_without_touching_anyone() -> None:
    assert plan_room((0,), 30 * GIB, {0: 30 * GIB}, [_n("a")], may_drain=False) == Fits()


def test_it_does_not_fit_and_the_lru_engine_goes_first() -> None:
    plan = plan_room((0,), 40 * GIB, {0: 30 * GIB}, [_n("a", last_used=5.0), _n("b", last_used=2.0)], may_drain=False)
    assert plan == Evict("b")


def test_no_engine_may_sleep_is_no_room_naming_the_numbers() -> None:
    plan = plan_room((0,), 40 * GIB, {0: 30 * GIB}, [_n("p", pinned=True)], may_drain=False)
    assert isinstance(plan, NoRoom)
    assert "40.00 GiB" in plan.why and "30.00 GiB" in plan.why


def test_known_footprints_that_could_never_make_room_evict_nobody() -> None:
    plan = plan_room((0,), 70 * GIB, {0: 10 * GIB}, [_n("a", footprint_bytes=20 * GIB)], may_drain=False)
    assert isinstance(plan, NoRoom) and "would free only 20.00 GiB" in plan.why


def test_an_unknown_footprint_or_unreadable_gpu_puts_every_engine_that_may_sleep_to_sleep_first() -> None:
    neighbours = [_n("a", last_used=3.0), _n("b", last_used=1.0)]
    assert plan_room((0,), None, {0: 70 * GIB}, neighbours, may_drain=False) == Evict("b")
    assert plan_room((0,), 10 * GIB, None, neighbours, may_drain=False) == Evict("b")
    assert plan_room((0,), None, None, [], may_drain=False) == Fits()


def test_an_engine_on_two_gpus_needs_half_on_each() -> None:
    assert plan_room((0, 1), 40 * GIB, {0: 20 * GIB, 1: 20 * GIB}, [], may_drain=False) == Fits()
    plan = plan_room((0, 1), 40 * GIB, {0: 20 * GIB, 1: 10 * GIB}, [_n("a", gpus=(1,))], may_drain=False)
    assert plan == Evict("a")
