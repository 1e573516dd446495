"""Memory admission for a wake on shared GPUs (proxy/sharing/swap_rules.py), no I/O."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proxy.gpu.readers import DeviceMemory, GpuReading
from proxy.lifecycle.rules import ALL_SLEEP_TAGS
from proxy.lifecycle.states import State
from proxy.sharing.swap_rules import (
    GIB,
    SLEEPABLE,
    Evict,
    Fits,
    Neighbour,
    NoRoom,
    Residency,
    eviction_order,
    free_per_gpu,
    plan_room,
    residency,
    wake_need,
)

IDLE = Neighbour(
    name="x",
    gpus=(0,),
    residency=Residency.AWAKE,
    pinned=False,
    busy=False,
    inflight=0,
    held=0,
    last_used=0.0,
    footprint_bytes=None,
)


def _n(name: str, **changes: object) -> Neighbour:
    return replace(IDLE, name=name, **changes)  # type: ignore[arg-type]


def test_free_memory_per_gpu_by_device_index() -> None:
    reading = GpuReading(devices=(DeviceMemory("a", 10 * GIB, 80 * GIB), DeviceMemory("b", 70 * GIB, 80 * GIB)))
    assert free_per_gpu(reading, (0, 1)) == {0: 70 * GIB, 1: 10 * GIB}
    assert free_per_gpu(reading, (2,)) is None  # a GPU the reader does not see: cannot say
    assert free_per_gpu(GpuReading(unavailable="no NVML"), (0,)) is None


def test_idle_least_recently_used_first_then_busy_ones_and_never_pinned_updating_or_elsewhere() -> None:
    """Was: an engine serving requests, or with requests held for it, was never put to sleep unless
    drain_before_sleep_s was set, so with mixed traffic most requests for the other model were refused (the
    H200 run: 30 of 48 refused with the defaults). Now it is drained first (the arbiter), after the idle ones."""
    neighbours = [
        _n("recent", last_used=9.0),
        _n("old", last_used=1.0),
        _n("pinned", pinned=True),
        _n("busy", busy=True),
        _n("holding", held=2, last_used=0.5),
        _n("asleep", residency=Residency.ASLEEP),
        _n("other-gpu", gpus=(1,)),
        _n("serving", inflight=1, last_used=0.1),
    ]
    assert [n.name for n in eviction_order((0,), neighbours)] == ["old", "recent", "serving", "holding"]


def test_it_fits_without_touching_anyone() -> None:
    assert plan_room((0,), 30 * GIB, {0: 30 * GIB}, [_n("a")]) == Fits()


def test_it_does_not_fit_and_the_lru_engine_goes_first() -> None:
    plan = plan_room((0,), 40 * GIB, {0: 30 * GIB}, [_n("a", last_used=5.0), _n("b", last_used=2.0)])
    assert plan == Evict("b")


def test_no_engine_may_sleep_is_no_room_naming_the_numbers() -> None:
    plan = plan_room((0,), 40 * GIB, {0: 30 * GIB}, [_n("p", pinned=True)])
    assert isinstance(plan, NoRoom)
    assert "40.00 GiB" in plan.why and "30.00 GiB" in plan.why


def test_known_footprints_that_could_never_make_room_evict_nobody() -> None:
    plan = plan_room((0,), 70 * GIB, {0: 10 * GIB}, [_n("a", footprint_bytes=20 * GIB)])
    assert isinstance(plan, NoRoom) and "would free only 20.00 GiB" in plan.why


def test_an_unknown_footprint_or_unreadable_gpu_puts_every_engine_that_may_sleep_to_sleep_first() -> None:
    neighbours = [_n("a", last_used=3.0), _n("b", last_used=1.0)]
    assert plan_room((0,), None, {0: 70 * GIB}, neighbours) == Evict("b")
    assert plan_room((0,), 10 * GIB, None, neighbours) == Evict("b")
    assert plan_room((0,), None, None, []) == Fits()


def test_an_engine_on_two_gpus_needs_half_on_each() -> None:
    assert plan_room((0, 1), 40 * GIB, {0: 20 * GIB, 1: 20 * GIB}, []) == Fits()
    plan = plan_room((0, 1), 40 * GIB, {0: 20 * GIB, 1: 10 * GIB}, [_n("a", gpus=(1,))])
    assert plan == Evict("a")


neighbours_strategy = st.lists(
    st.builds(
        Neighbour,
        name=st.sampled_from("abcdefgh"),
        gpus=st.sampled_from([(0,), (1,), (0, 1)]),
        residency=st.sampled_from(Residency),
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
)
def test_a_plan_never_picks_an_engine_it_must_not_and_never_calls_a_shortfall_a_fit(
    gpus: tuple[int, ...], need: int | None, free: dict[int, int] | None, neighbours: list[Neighbour]
) -> None:
    free_bytes = {g: v * GIB for g, v in free.items()} if free is not None else None
    plan = plan_room(gpus, need, free_bytes, neighbours)
    if isinstance(plan, Evict):
        victim = next(n for n in neighbours if n.name == plan.victim)
        assert victim.residency in SLEEPABLE and not victim.pinned and not victim.busy
        assert set(victim.gpus) & set(gpus)
        idle = [n for n in eviction_order(gpus, neighbours) if n.inflight == 0 and n.held == 0]
        assert victim.inflight == victim.held == 0 or not idle  # a busy one only when no idle one may go
    if isinstance(plan, Fits) and need is not None and free_bytes is not None:
        assert all(free_bytes[g] >= need / len(gpus) for g in gpus)
    if isinstance(plan, Fits) and (need is None or free_bytes is None):
        assert eviction_order(gpus, neighbours) == []  # nobody left who could sleep
        assert not any(n.holds_memory and set(n.gpus) & set(gpus) for n in neighbours)  # nor keeps memory


def test_unknown_memory_beside_an_engine_that_stays_awake_is_refused_not_woken() -> None:
    """Finding of the real-vLLM run (`--gpu-probe none`): with nothing to say it fits, a pinned or updating
    neighbour that stays awake made the wake go ahead, two engines awake that may not fit."""
    for staying in (_n("policy", pinned=True), _n("policy", busy=True)):
        plan = plan_room((0,), 10 * GIB, None, [staying])
        assert isinstance(plan, NoRoom) and "policy" in plan.why
        plan = plan_room((0,), None, {0: 70 * GIB}, [staying])
        assert isinstance(plan, NoRoom) and "footprint" in plan.why
    # Asleep, or on another GPU: nothing stays awake beside it.
    assert plan_room((0,), None, None, [_n("a", residency=Residency.ASLEEP), _n("b", gpus=(1,))]) == Fits()


# --- found by the two-engine chaos run (docs/reliability.md): what a neighbour holds is not its state


def test_what_an_engine_holds_follows_its_tags_not_only_its_state() -> None:
    scheduling = frozenset({"scheduling"})
    assert residency(State.RUNNING, frozenset()) is Residency.AWAKE
    assert residency(State.PAUSED, frozenset()) is Residency.AWAKE
    assert residency(State.SLEEPING, scheduling) is Residency.ASLEEP_LEVEL_0
    assert residency(State.SLEEPING, ALL_SLEEP_TAGS) is Residency.ASLEEP
    # Chaos seed 7: b asleep by its flags after a lie-memory sleep, its 50 GiB still on the device.
    assert residency(State.SLEEPING, ALL_SLEEP_TAGS, unconfirmed=True) is Residency.ASLEEP_UNCONFIRMED
    assert residency(State.SLEEPING, frozenset({"kv_cache"})) is Residency.PARTLY_AWAKE  # weights woken
    assert residency(State.SLEEPING, frozenset({"weights"})) is Residency.PARTLY_AWAKE
    # A pause, resume or sleep under way: the swap's sleep waits its turn (chaos seed 11: 145 no_room swaps
    # refused for a neighbour "in a lifecycle call" that a moment later could have been put to sleep).
    for on_the_way in (State.FALLING_ASLEEP, State.PAUSING, State.RESUMING):
        assert residency(on_the_way, frozenset()) is Residency.AWAKE
    for changing in (State.WAKING, State.UPDATING_WEIGHTS):
        assert residency(changing, frozenset()) is Residency.CHANGING
    assert residency(State.FAILED, frozenset()) is Residency.UNKNOWN
    assert residency(State.STARTING, ALL_SLEEP_TAGS) is Residency.UNKNOWN


def test_a_neighbour_asleep_at_level_0_or_paused_is_put_to_a_real_sleep_first() -> None:
    """Seed 11: `b` asleep at level 0 kept its 50 GiB; not RUNNING, it was neither put to sleep nor counted."""
    for holding in (Residency.ASLEEP_LEVEL_0, Residency.AWAKE):
        neighbour = _n("b", residency=holding, footprint_bytes=50 * GIB)
        assert plan_room((0,), None, {0: 28 * GIB}, [neighbour]) == Evict("b")
        assert plan_room((0,), 48 * GIB, {0: 28 * GIB}, [neighbour]) == Evict("b")
    assert plan_room((0,), None, {0: 78 * GIB}, [_n("b", residency=Residency.ASLEEP)]) == Fits()


def test_a_neighbour_that_keeps_its_memory_and_cannot_sleep_refuses_an_unknown_need() -> None:
    """Partly awake (vLLM's /sleep is a no-op until every tag is awake), in a lifecycle call, or asleep at
    level 0 but pinned: it keeps its memory, and nothing says the wake fits beside it."""
    for staying in (
        _n("b", residency=Residency.PARTLY_AWAKE),
        _n("b", residency=Residency.CHANGING),
        _n("b", residency=Residency.ASLEEP_LEVEL_0, pinned=True),
        # Chaos seed 11: b's wake failed its canary (FAILED, 50 GiB still on the device); a's wake with its
        # footprint unknown saw nobody keeping memory and went into vLLM's out of memory, 68 times.
        _n("b", residency=Residency.UNKNOWN),
        _n("b", residency=Residency.ASLEEP_UNCONFIRMED),  # vLLM's /sleep would not free it: asleep already
    ):
        plan = plan_room((0,), None, {0: 46 * GIB}, [staying])
        assert isinstance(plan, NoRoom) and "b" in plan.why, staying
        plan = plan_room((0,), 48 * GIB, {0: 28 * GIB}, [staying])
        assert isinstance(plan, NoRoom), staying
    # Known numbers that fit beside it: woken (the GPUs' free memory already counts what it holds).
    assert plan_room((0,), 20 * GIB, {0: 28 * GIB}, [_n("b", residency=Residency.PARTLY_AWAKE)]) == (Fits())


def test_a_wake_needs_only_what_is_not_resident_yet() -> None:
    """Seed 11: a wake from level 0 (or of the weights after a kv_cache-only wake) was asked for the whole
    footprint and refused beside a pinned neighbour, though it adds nothing (or only the rest)."""
    scheduling, kv_only = frozenset({"scheduling"}), frozenset({"kv_cache"})
    weights = frozenset({"weights"})
    assert wake_need(50 * GIB, scheduling, scheduling, awake_bytes=None, resident=None) == 0
    assert wake_need(None, scheduling, scheduling, awake_bytes=None, resident=None) == 0  # unknown footprint too
    assert wake_need(48 * GIB, ALL_SLEEP_TAGS, ALL_SLEEP_TAGS, awake_bytes=50 * GIB, resident=2 * GIB) == 48 * GIB
    assert wake_need(None, ALL_SLEEP_TAGS, ALL_SLEEP_TAGS, awake_bytes=None, resident=None) is None
    # The weights asleep, the KV cache awake (34 of 50 GiB resident): 16 GiB to come.
    assert wake_need(48 * GIB, weights, weights, awake_bytes=50 * GIB, resident=34 * GIB) == 16 * GIB
    # Not knowing what it holds or takes awake (NVML's device totals): the whole footprint, conservatively.
    assert wake_need(48 * GIB, kv_only, kv_only, awake_bytes=None, resident=18 * GIB) == 48 * GIB
    assert wake_need(48 * GIB, kv_only, kv_only, awake_bytes=50 * GIB, resident=None) == 48 * GIB
    assert wake_need(48 * GIB, weights, frozenset(), awake_bytes=None, resident=None) == 0  # wakes nothing
    # A sleep that freed nothing (seed 7): all 50 GiB are there, its wake adds nothing and may go ahead.
    assert wake_need(48 * GIB, ALL_SLEEP_TAGS, ALL_SLEEP_TAGS, awake_bytes=50 * GIB, resident=50 * GIB) == 0
    # A need of nothing fits beside anyone, even with the GPUs unreadable.
    assert plan_room((0,), 0, None, [_n("a", pinned=True)]) == Fits()


def test_a_refusal_names_each_engine_that_stays_and_why() -> None:
    """The two-engine chaos run's no_room refusals said only "(pinned, busy or serving)": which one, and why?"""
    neighbours = [
        _n("p", pinned=True),
        _n("w", busy=True),
        _n("f", residency=Residency.UNKNOWN),
        _n("z", residency=Residency.ASLEEP),
    ]
    plan = plan_room((0,), 48 * GIB, {0: 28 * GIB}, neighbours)
    assert isinstance(plan, NoRoom)
    assert "f (failed or starting), p (pinned), w (in a weight update" in plan.why
    assert "z" not in plan.why  # asleep: holds nothing worth naming
    # Serving, or with requests held for it, is no reason to stay: it is drained and put to sleep.
    assert plan_room((0,), None, {0: 28 * GIB}, [_n("s", inflight=3, held=1)]) == Evict("s")


def test_memory_no_engine_of_this_proxy_holds_is_named_as_held_outside_it() -> None:
    """Several pods on one GPU (gpu_lock_dir): the device's free memory counts another pod's engine, which this
    proxy cannot put to sleep; the refusal says so rather than blame an engine of its own."""
    asleep = _n("mine-asleep", residency=Residency.ASLEEP)
    plan = plan_room((0,), 48 * GIB, {0: 28 * GIB}, [asleep])
    assert isinstance(plan, NoRoom)
    assert plan.why == (
        "it needs 48.00 GiB on GPU 0, 28.00 GiB is free, and the rest is memory held outside this proxy (another "
        "pod's engine, or another process on that GPU), which this lifeguard cannot put to sleep"
    )
    pinned = _n("mine-pinned", pinned=True)
    plan = plan_room((0,), 48 * GIB, {0: 28 * GIB}, [pinned])
    assert isinstance(plan, NoRoom) and "no engine there may be put to sleep (mine-pinned (pinned))" in plan.why


def test_a_neighbour_short_of_host_memory_stays_and_one_lowered_to_level_2_is_evicted_so() -> None:
    short = "its level-1 sleep would pin 16.00 GiB of host memory, 8.00 GiB is available"
    free = {0: 10 * GIB}
    staying = _n("a", footprint_bytes=50 * GIB, host_memory_short=short)
    plan = plan_room((0,), 40 * GIB, free, [staying])
    assert isinstance(plan, NoRoom) and f"a ({short})" in plan.why
    assert plan_room((0,), 40 * GIB, free, [staying, _n("b", footprint_bytes=50 * GIB, last_used=9.0)]) == Evict("b")
    assert plan_room((0,), 40 * GIB, free, [_n("c", footprint_bytes=50 * GIB, sleep_level=2)]) == Evict("c", 2)
