"""`Reachability`: an upstream that cannot be reached is said at WARNING at once, again every REPEAT_S while it
stays so (the loop's own clock, never the wall), and once at INFO when it answers; the sentence is what the state
and the readiness answers carry."""

from __future__ import annotations

import logging

import pytest

from proxy.lifecycle.reachability import REPEAT_S, Reachability
from proxy.upstream.observation import Observation

REFUSED = Observation(reachable=False, error="vLLM could not be reached for GET /health: ...", why="connection refused")
LATE = Observation(reachable=False, timed_out=True, why="no answer to GET /health within 10 s")
ANSWERS = Observation(reachable=True, healthy=False)  # a 503 from /health is an answer


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    lines = [(record.levelname, record.getMessage()) for record in caplog.records]
    caplog.clear()
    return lines


def test_said_at_once_again_at_a_bounded_rate_and_once_when_it_answers(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    reach = Reachability("http://127.0.0.1:8000", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="lifeguard.reconcile")
    reach.observed(REFUSED)
    assert said(caplog) == [("WARNING", "vLLM at http://127.0.0.1:8000 cannot be reached: connection refused "
                                        f"(said again every {REPEAT_S:g} s until it answers)")]  # fmt: skip
    for _ in range(100):  # a STARTING engine's rounds come every 0.25 s
        now[0] += 0.25
        reach.observed(REFUSED if now[0] < 110 else LATE)
    assert said(caplog) == []
    now[0] = 100.0 + REPEAT_S
    reach.observed(LATE)
    assert said(caplog) == [("WARNING", "vLLM at http://127.0.0.1:8000 cannot be reached: no answer to GET /health "
                                        f"within 10 s (said again every {REPEAT_S:g} s until it answers)")]  # fmt: skip
    assert reach.sentence == "vLLM at http://127.0.0.1:8000 cannot be reached: no answer to GET /health within 10 s"
    now[0] += 1.5
    reach.observed(ANSWERS)
    assert said(caplog) == [("INFO", f"vLLM at http://127.0.0.1:8000 answers again, after {REPEAT_S + 1.5:.1f} s "
                                     "unreachable")]  # fmt: skip
    assert reach.sentence is None and reach.snapshot() is None
    reach.observed(ANSWERS)
    assert said(caplog) == []


def test_an_upstream_that_answers_from_the_start_is_never_mentioned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lifeguard.reconcile")
    reach = Reachability("http://127.0.0.1:8000")
    reach.observed(Observation(reachable=True, healthy=True))
    assert said(caplog) == [] and reach.snapshot() is None
