"""What every pytest run holds a test to beyond passing, so that CI cannot go green while coverage is gone
(tests/README.md, "What CI holds every test to"). Its hooks are tests/conftest.py's (imported there); the tooling
tests run pytest on files of their own with `-p ci_rules` (tests/tooling/test_ci_rules.py).

* An xfail pins a known bug, and only that: strict (the day the bug is fixed it fails, and is turned into a plain
  test) and with `raises=` (the bug's own exception: a test whose body broke, a method renamed under it, is a
  failure, not the bug). A test that reports xfailed any other way fails: a non-strict xfail, one without
  `raises=`, `run=False` (it never runs), a `pytest.xfail()` call.
* Under .ci/run (LIFEGUARD_CI_RECORD, the group's folder) each run records the tests it collected, before its
  markers and `-k` chose, and those it then ran: scripts/ci_summary.py fails a test that a group
  collected and no group ran (a `ui` test left in tests/e2e: `make test` leaves it out by its marker, and
  `make test-ui` runs only tests/ui).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Sequence
from pathlib import Path

import pytest

CI_RECORD = os.environ.get("LIFEGUARD_CI_RECORD")
RULE = "a known bug is pinned by @pytest.mark.xfail(strict=True, raises=TheBugsError, reason=...) (tests/README.md)"


def xfail_problem(item: pytest.Item) -> str | None:
    """Why the xfail that `item` reported breaks the rule, or None."""
    marks = list(item.iter_markers("xfail"))
    if not marks:
        return "pytest.xfail() called: an xfail that no marker declares"
    for mark in marks:
        if not mark.kwargs.get("strict", item.config.getini("xfail_strict")):
            return "a non-strict xfail: it passes unnoticed the day the bug is gone"
        if mark.kwargs.get("raises") is None:
            return "an xfail without raises=: any error at all, a broken test body too, counts as the bug"
        if mark.kwargs.get("run", True) is False:
            return "an xfail with run=False: the test never runs"
    return None


Reporting = Generator[None, pytest.TestReport, pytest.TestReport]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Reporting:
    report = yield
    reason = getattr(report, "wasxfail", None)
    if reason is not None:
        problem = xfail_problem(item)
        if problem is not None:
            del report.wasxfail  # JUnit XML would record a failure that still carries it as a skip
            report.outcome = "failed"
            report.longrepr = f"{problem}; {RULE} (its reason: {reason!r})"
    return report


def _record(kind: str, items: Sequence[pytest.Item]) -> None:
    if CI_RECORD:
        path = Path(CI_RECORD) / f"{kind}-{os.getpid()}.txt"
        path.write_text("".join(f"{item.nodeid}\n" for item in items))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test collected, before the markers, -k or --deselect leave some out."""
    _record("collected", items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests this run goes on to run."""
    _record("selected", session.items)
