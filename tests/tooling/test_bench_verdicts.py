"""benchmarks/verdicts.py: every target of issue 39 is printed under `make bench`'s table as MET, MISSED or not
run, with the figure that decided it (no load runs here: the figures are made up)."""

from __future__ import annotations

import argparse

from benchmarks.verdicts import issue39_lines


def _lines(res: dict[str, object], held: int = 10_000) -> list[str]:
    lines: list[str] = issue39_lines(res, argparse.Namespace(held=held))
    return lines[1:]


def test_every_target_is_listed_and_a_load_that_did_not_run_says_so() -> None:
    lines = _lines({})
    assert len(lines) == 12
    assert all(line.startswith("- not run — ") for line in lines), lines


def test_a_measured_target_is_met_or_missed_with_its_figure() -> None:
    res = {
        "fixed": {
            "nginx@64": {"cpu_us_per_req": 30.0, "rps": 20_000.0},
            "lifeguard@64": {"cpu_us_per_req": 60.0, "rps": 16_000.0},
            "lifeguard-2e@64": {"cpu_us_per_req": 63.0, "rps": 15_000.0},
        },
        "sse": {"cpu@512": {"worst": 1.1, "best": 0.9, "runs": 2}, "cpu@2048": {"worst": 1.3, "best": 1.0, "runs": 2}},
        "hold": {"bytes_per_held_client": 1800.0},
    }
    lines = {line.split(": ")[0]: line for line in _lines(res)}
    assert lines["- MISSED — rig's fixed row, CPU per request, 64 conn, lifeguard ÷ nginx"].endswith(
        "2.00× (target ≤ 1.5× nginx)"
    )
    assert lines["- MET — rig's fixed row, req/s, 64 conn, lifeguard ÷ nginx"]
    assert lines["- MET — two engines ÷ one engine, CPU per request, 64 conn"]
    assert lines["- MET — SSE CPU per event, 512 streams, lifeguard ÷ nginx"]
    assert lines["- MISSED — SSE CPU per event, 2,048 streams, lifeguard ÷ nginx"]
    assert "1,800 B" in lines["- MET — memory per held client, 10,000 held"]


def test_a_release_burst_that_lost_a_stream_is_missed_however_fast() -> None:
    release = {"count": 2048, "ratios": [0.8, 0.9, 1.0], "answered_share": 1.0, "server_errors": 1}
    (line,) = [line for line in _lines({"release": release}) if "release burst" in line]
    assert line.startswith("- MISSED — ") and "1 5xx" in line


def test_figures_of_a_smaller_case_than_the_targets_name_are_not_judged() -> None:
    res = {
        "release": {"count": 512, "ratios": [1.0], "answered_share": 1.0, "server_errors": 0},
        "hold": {"bytes_per_held_client": 1800.0},
    }
    lines = _lines(res, held=2_000)
    assert [line for line in lines if "release burst" in line or "held client" in line] == [
        line for line in lines if line.startswith("- not run — ") and ("release burst" in line or "held client" in line)
    ]
