"""Memory admission for a wake on shared GPUs (proxy/swap_rules.py), no I/O."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

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


neighbours_strategy = st.lists(
    st.builds(
        Neighbour,
        name=st.sampled_from("abcdefgh"),
        gpus=st.sampled_from([(0,), (1,), (0, 1)]),
        awake=st.booleans(),
        pinned=st.booleans(),
        busy=st.booleans(),
        inflight=st.integers(0, 2),
        held=st.integers(0, 2),
        last_used=st.floats(0, 100),
        footprint_bytes=st.one_of(st.none(), st.integers(1, 80).map(lambda g: g * GIB)),
    ),
    max_size=6,
    unique_by=lambda n: n.name,
)


@given(
    gpus=st.sampled_from([(0,), (1,), (0, 1)]),
    need=st.one_of(st.none(), st.integers(1, 80).map(lambda g: g * GIB)),
    free=st.one_of(st.none(), st.fixed_dictionaries({0: st.integers(0, 80), 1: st.integers(0, 80)})),
    neighbours=neighbours_strategy,
    may_drain=st.booleans(),
)
def test_a_plan_never_picks_an_engine_it_must_not_and_never_calls_a_shortfall_a_fit(
    gpus: tuple[int, ...], need: int | None, free: dict[int, int] | None, neighbours: list[Neighbour], may_drain: bool
) -> None:
    free_bytes = {g: v * GIB for g, v in free.items()} if free is not None else None
    plan = plan_room(gpus, need, free_bytes, neighbours, may_drain=may_drain)
    if isinstance(plan, Evict):
        victim = next(n for n in neighbours if n.name == plan.victim)
        assert victim.awake and not victim.pinned and not victim.busy and victim.held == 0
        assert set(victim.gpus) & set(gpus)
        assert victim.inflight == 0 or may_drain
    if isinstance(plan, Fits) and need is not None and free_bytes is not None:
        assert all(free_bytes[g] >= need / len(gpus) for g in gpus)
    if isinstance(plan, Fits) and (need is None or free_bytes is None):
        assert eviction_order(gpus, neighbours, may_drain=may_drain) == []  # nobody left who could sleep


def test_unknown_memory_beside_an_engine_that_stays_awake_is_refused_not_woken() -> None:
    """Finding of the real-vLLM run (`--gpu-probe none`): with nothing to say it fits, a pinned or serving
    neighbour that stays awake made the wake go ahead, two engines awake that may not fit."""
    for staying in (_n("policy", pinned=True), _n("policy", inflight=2)):
        plan = plan_room((0,), 10 * GIB, None, [staying], may_drain=False)
        assert isinstance(plan, NoRoom) and "policy" in plan.why
        plan = plan_room((0,), None, {0: 70 * GIB}, [staying], may_drain=False)
        assert isinstance(plan, NoRoom) and "footprint" in plan.why
    # Asleep, or on another GPU: nothing stays awake beside it.
    assert plan_room((0,), None, None, [_n("a", awake=False), _n("b", gpus=(1,))], may_drain=False) == Fits()
