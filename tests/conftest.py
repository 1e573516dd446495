"""What every test directory shares: the proxy as `vllm-lifeguard serve` runs it (`serve_lifeguard`), and
clients whose every wait has a deadline shorter than pytest's own (120 s), so that a hang is named, not
hidden. Under `.ci/run` (LIFEGUARD_CI_RECORD, the group's folder) every pytest run records its JUnit XML and
each rerun there, for the summary per group (scripts/ci_summary.py)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp.test_utils import TestClient

from proxy.config import Settings

# The rules every run holds a test to (an xfail pins a known bug and only that; what each CI run collected and ran).
from tests.ci_rules import pytest_collection_finish, pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401
from tests.lifeguard_testing import LifeguardServer, ServeLifeguard, client_timeout

CI_RECORD = os.environ.get("LIFEGUARD_CI_RECORD")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if CI_RECORD and not config.option.xmlpath:  # a run that names its own JUnit file writes it there itself
        config.option.xmlpath = str(Path(CI_RECORD) / f"pytest-{os.getpid()}.xml")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each rerun (pytest-rerunfailures), with its first failure's reason: CI lists and counts them."""
    if CI_RECORD and report.outcome == "rerun":
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
        where = f"{os.path.relpath(crash.path)}:{crash.lineno}" if crash is not None else ""
        # What a test's harness attached to its report (tests/vllm: each proxy's log tail), for the CI log.
        logs = {name: content for name, content in report.sections if name.startswith("proxy log")}
        record = {"test": report.nodeid, "when": report.when, "reason": str(reason), "where": where, "logs": logs}
        with open(Path(CI_RECORD) / "reruns.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


#: The loop every async test runs on: `serve`'s (uvloop), or asyncio's own, its fallback (`make test` runs both).
TEST_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    name = os.environ.get("LIFEGUARD_TEST_LOOP", "uvloop")
    return {name: TEST_LOOPS[name]}


@pytest.fixture
def aiohttp_client(aiohttp_client: Any) -> Callable[..., Awaitable[TestClient[Any, Any]]]:
    """pytest-aiohttp's, with a default deadline on every request (aiohttp's own is 300 s)."""

    async def make(target: Any, **kwargs: Any) -> TestClient[Any, Any]:
        kwargs.setdefault("timeout", client_timeout())
        client: TestClient[Any, Any] = await aiohttp_client(target, **kwargs)
        return client

    return make


@pytest.fixture
def serve_lifeguard(aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]]) -> ServeLifeguard:
    """`await serve_lifeguard(settings)`: the proxy listening, and a client for it (`client.server.lifeguard`)."""

    async def serve(settings: Settings, **lifeguard: Any) -> TestClient[Any, Any]:
        return await aiohttp_client(LifeguardServer(settings, **lifeguard))

    return serve
