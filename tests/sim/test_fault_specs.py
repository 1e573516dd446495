"""Parsing ``OP:KIND[@N|@pP]`` and the book that decides which fault fires."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifeguard_sim.faults import KINDS, OPS, FaultBook, FaultSpecError, parse_fault


def test_a_spec_without_suffix_fires_once() -> None:
    spec = parse_fault("wake_up:error500")
    assert (spec.op, spec.kind, spec.times, spec.probability) == ("wake_up", "error500", 1, None)


def test_at_n_arms_the_next_n_calls() -> None:
    assert parse_fault("sleep:hang@3").times == 3


def test_at_p_sets_a_probability() -> None:
    spec = parse_fault("sleep:lie-dead@p0.1")
    assert (spec.times, spec.probability) == (None, 0.1)


def test_slow_carries_its_seconds() -> None:
    spec = parse_fault("generate:slow:0.5@2")
    assert (spec.kind, spec.seconds, spec.times) == ("slow", 0.5, 2)


@pytest.mark.parametrize(
    "text",
    [
        "nap:error500",
        "sleep",
        "sleep:explode",
        "sleep:error500@0",
        "sleep:error500@x",
        "sleep:error500@p0",
        "sleep:error500@p1.5",
        "sleep:slow:soon",
        "sleep:slow:-1",
        "pause:lie-memory",
        "generate:lie-asleep",
        "sleep:lose-lora",
        "wake_up:retire",
        "generate:scale-fails",
        "generate:lie-weights",
    ],
)
def test_malformed_specs_are_rejected_by_name(text: str) -> None:
    with pytest.raises(FaultSpecError, match="bad fault spec"):
        parse_fault(text)


@given(
    op=st.sampled_from(OPS),
    kind=st.sampled_from(
        [
            k
            for k in KINDS
            if k
            not in (
                "slow:S",
                "stall:S",
                "lie-memory",
                "lie-asleep",
                "lose-lora",
                "retire",
                "scale-fails",
                "lie-weights",
                "partial",
                "freed-500",
                "engine-fault",
                "checkpoint-fails",
            )
        ]
    ),
    suffix=st.one_of(st.just(""), st.integers(1, 99).map(lambda n: f"@{n}"), st.just("@p0.25")),
)
def test_every_documented_op_and_kind_parses(op: str, kind: str, suffix: str) -> None:
    spec = parse_fault(f"{op}:{kind}{suffix}")
    assert (spec.op, spec.kind) == (op, kind)


@pytest.mark.parametrize(
    ("spec", "kind", "seconds"),
    [
        ("update_weights:partial", "partial", 0.0),
        ("sleep:freed-500@2", "freed-500", 0.0),
        ("generate:stall:2.5", "stall", 2.5),
        ("generate:engine-fault", "engine-fault", 0.0),
        ("checkpoint_prepare:checkpoint-fails", "checkpoint-fails", 0.0),
        ("checkpoint_restore:checkpoint-fails", "checkpoint-fails", 0.0),
    ],
)
def test_the_kinds_of_one_operation_parse_there_and_carry_their_seconds(spec: str, kind: str, seconds: float) -> None:
    parsed = parse_fault(spec)
    assert (parsed.kind, parsed.seconds) == (kind, seconds)
    fired = FaultBook(0, [spec]).draw(parsed.op)
    assert (fired.kind, fired.seconds) == (kind, seconds)


@pytest.mark.parametrize(
    "spec", ["wake_up:partial", "wake_up:freed-500", "sleep:stall:1", "generate:stall", "sleep:checkpoint-fails"]
)
def test_the_kinds_of_one_operation_are_refused_elsewhere(spec: str) -> None:
    with pytest.raises(FaultSpecError, match="bad fault spec"):
        parse_fault(spec)


def test_a_once_fault_fires_exactly_once() -> None:
    book = FaultBook(0, ["wake_up:error500"])
    assert book.draw("wake_up").kind == "error500"
    assert book.draw("wake_up").kind is None
    assert book.active() == []


def test_an_n_fault_fires_n_times_and_only_for_its_op() -> None:
    book = FaultBook(0, ["sleep:error500@2"])
    assert book.draw("wake_up").kind is None
    assert [book.draw("sleep").kind for _ in range(3)] == ["error500", "error500", None]


def test_probability_faults_are_reproducible_from_the_seed() -> None:
    def run(seed: int) -> list[str | None]:
        book = FaultBook(seed, ["generate:garbage@p0.5"])
        return [book.draw("generate").kind for _ in range(40)]

    assert run(7) == run(7)
    assert 0 < run(7).count("garbage") < 40


def test_slow_adds_to_another_fault() -> None:
    book = FaultBook(0, ["sleep:slow:0.25", "sleep:error500"])
    fired = book.draw("sleep")
    assert (fired.kind, fired.extra_seconds) == ("error500", 0.25)


def test_replace_keeps_the_old_faults_when_a_spec_is_bad() -> None:
    book = FaultBook(0, ["sleep:hang"])
    with pytest.raises(FaultSpecError):
        book.replace(["sleep:crash", "oops"])
    assert [f["spec"] for f in book.active()] == ["sleep:hang"]
