"""A policy that keeps failing the same way (each held request of a sleeping engine asks for the wake again,
and no GPU has room) writes one log line per 30 s saying how many it left out, not one line per request:
`make chaos-pods` wrote hundreds a second."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from proxy.errors import EngineAsleep, WeightsAsleep
from proxy.lifecycle import policies
from proxy.lifecycle.parsed_calls import LifecycleCall
from proxy.lifecycle.policies import Policies


def _policies(*errors: Exception | None) -> Policies:
    """Policies whose coordinator fails each call with the next of `errors` (None: that call succeeds)."""
    pending = list(errors)

    async def submit(call: LifecycleCall) -> None:
        error = pending.pop(0) if pending else None
        if error is not None:
            raise error

    coordinator = SimpleNamespace(submit=submit)
    return Policies(cast(Any, None), cast(Any, coordinator), cast(Any, None), cast(Any, None))


async def test_the_same_failure_again_is_counted_not_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="lifeguard.policy")
    now = [1000.0]
    monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
    failing = _policies(*(EngineAsleep("no GPU has room") for _ in range(51)))
    for _ in range(50):
        await failing._run(LifecycleCall("wake_up"))
        now[0] += 0.1
    assert [r.getMessage() for r in caplog.records] == ["policy wake_up failed: no GPU has room"]

    now[0] += 30  # 35 s after the first line: the same failure once more
    caplog.clear()
    await failing._run(LifecycleCall("wake_up"))
    assert [r.getMessage() for r in caplog.records] == [
        "policy wake_up failed: no GPU has room (49 more like it in the last 35 s)"
    ]


async def test_another_failure_or_a_success_between_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lifeguard.policy")
    room, asleep = EngineAsleep("no room"), WeightsAsleep("weights asleep")
    policy = _policies(room, asleep, room, None, room)
    for _ in range(5):  # the fourth call succeeds
        await policy._run(LifecycleCall("wake_up"))
    assert [r.getMessage() for r in caplog.records] == [
        "policy wake_up failed: no room",
        "policy wake_up failed: weights asleep",
        "policy wake_up failed: no room",
        "policy wake_up failed: no room",
    ]
