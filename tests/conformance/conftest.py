"""Fixtures for the conformance scenarios.

By default ``engine_url`` is an in-process simulator, once per vLLM release in ``EVERY_SCENARIO`` (0.32 and 0.33):
every scenario runs against both, and ``vllm_version`` says which one a scenario faces (read from the engine's
/version, real or simulated). The 0.34 profile differs from 0.33 only where its scenarios say so: a module or test
marked ``on_profiles("0.33", "0.34")`` runs against those instead (the whole suite on 0.34 costs about 13 s more per
run, and `make test` runs it twice). Set ``CONFORMANCE_ENGINE_URL`` (and, if the
served name is not "tiny", ``CONFORMANCE_MODEL``) to run the same scenarios against a real vLLM started with
``VLLM_SERVER_DEV_MODE=1 --enable-server-load-tracking``; the hold scenarios read ``/load`` to see a
request has reached the engine. Checks that only the simulator can answer take the ``sim_only`` fixture
and are skipped then.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from lifeguard_sim.versions import PROFILES
from tests.conformance.api import VllmApi

REAL_ENGINE_URL = os.environ.get("CONFORMANCE_ENGINE_URL")
MODEL = os.environ.get("CONFORMANCE_MODEL", "tiny")
# Paced like vLLM-on-CPU with the tiny model (500 tokens in about 2 s), with quick sleeps and wakes.
# The real engine is started with --enable-scale-out (scripts/vllm/vllm_server.py main()), so the
# simulator serves /inference/v1/generate too.
SIM_SETTINGS = SimSettings(
    model=MODEL, token_seconds=0.004, sleep_seconds=0.02, wake_seconds=0.03, enable_scale_out=True, enable_lora=True
)


@pytest.fixture
def sim_only() -> None:
    if REAL_ENGINE_URL:
        pytest.skip("simulator-only check (CONFORMANCE_ENGINE_URL points at a real engine)")


EVERY_SCENARIO = ("0.32", "0.33")


def on_profiles(*versions: str) -> pytest.MarkDecorator:
    """Run a scenario (or, as `pytestmark`, a module) against these simulator profiles instead of EVERY_SCENARIO;
    against a real engine, once."""
    unknown = set(versions) - set(PROFILES)
    assert not unknown, f"no simulator profile {sorted(unknown)}"
    return pytest.mark.parametrize("sim_version", [None] if REAL_ENGINE_URL else list(versions))


@pytest.fixture(params=[None] if REAL_ENGINE_URL else EVERY_SCENARIO)
def sim_version(request: pytest.FixtureRequest) -> str | None:
    """The simulator's profile, or None against a real engine."""
    version: str | None = request.param
    return version


@pytest.fixture
def sim_settings(sim_version: str | None) -> SimSettings:
    """The simulator's settings for this scenario: override this fixture in a module to start it otherwise."""
    return dataclasses.replace(SIM_SETTINGS, vllm_version=sim_version or SIM_SETTINGS.vllm_version)


@pytest.fixture
async def sim_server(aiohttp_server: Any, sim_version: str | None, sim_settings: SimSettings) -> Any:
    if sim_version is None:
        return None
    return await aiohttp_server(create_sim_app(sim_settings))


@pytest.fixture
def engine_url(sim_server: Any) -> str:
    if REAL_ENGINE_URL:
        return REAL_ENGINE_URL.rstrip("/")
    return str(sim_server.make_url("")).rstrip("/")


@pytest.fixture
def sim_engine(sim_only: None, sim_server: Any) -> Engine:
    engine: Engine = sim_server.app[SIM_ENGINE]
    return engine


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        yield client


@pytest.fixture
async def vllm_version(session: aiohttp.ClientSession, engine_url: str) -> str:
    """ "0.32", "0.33" or "0.34": the release the engine under test says it is (its /version), real or simulated."""
    async with session.get(engine_url + "/version") as resp:
        version = str((await resp.json())["version"])
    return ".".join(version.split(".")[:2])


@pytest.fixture
async def vllm(session: aiohttp.ClientSession, engine_url: str) -> AsyncIterator[VllmApi]:
    """The engine under test, awake and unpaused before and after each scenario."""
    api = VllmApi(session, engine_url, MODEL)
    # /wake_up also lifts a plain /pause, so it is the one call that restores a clean engine.
    assert (await api.wake()).status == 200
    yield api
    assert (await api.wake()).status == 200
