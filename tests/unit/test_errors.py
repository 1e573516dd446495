"""The error tree: one class per reason, so the reasons the proxy answers with are a closed set."""

from __future__ import annotations

import re

from proxy.errors import REASONS, LifeguardError
from proxy.metrics import CHECK_RESULTS, CHECKS, HOLD_OUTCOMES
from proxy.probes import CheckName, CheckResult


def _tree(cls: type[LifeguardError]) -> list[type[LifeguardError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _tree(child))]


def test_a_reason_is_a_class_attribute_never_an_argument() -> None:
    """`reason=` was a free string at each raise; a typo invented a new X-Lifeguard-Reason and metric label."""
    error = LifeguardError("x")
    assert error.reason == "proxy_error"
    for cls in _tree(LifeguardError):
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", cls.reason), cls
        assert "reason" not in cls.__init__.__code__.co_varnames


def test_each_reason_has_one_status() -> None:
    status: dict[str, int] = {}
    for cls in _tree(LifeguardError):
        if cls.__name__ == "UpstreamRejected":
            continue  # carries vLLM's own 4xx
        assert status.setdefault(cls.reason, cls.status) == cls.status, cls


def test_the_gate_outcomes_are_reasons() -> None:
    assert {"hold_timeout", "hold_queue_full", "shutting_down"} <= REASONS
    assert {"hold_timeout", "hold_queue_full", "shutting_down"} <= set(HOLD_OUTCOMES)


def test_the_metric_label_sets_are_the_verifiers_vocabulary() -> None:
    assert set(CHECKS) == set(CheckName)
    assert set(CHECK_RESULTS) == set(CheckResult)
