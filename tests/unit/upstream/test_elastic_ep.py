"""proxy/upstream/elastic_ep.py and VllmClient.observe: vLLM's elastic-EP gate and status, read as the proxy reads them.

The bodies are vLLM's (serve/elastic_ep/middleware.py and api_router.py, 0.32 and 0.33); the verdict never comes
from the middleware's message and never from /health, which 0.33 lets through the gate (200 on a retired rank).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, cast

import aiohttp
import pytest

from proxy.upstream.elastic_ep import ElasticStatus, ElasticVerdict, gate_message, parse_status
from proxy.upstream.vllm_client import Reply, VllmClient

SCALING_BODY = b'{"error":"The model is currently scaling. Please try again later."}'
RETIRED_BODY = b'{"error":"This data-parallel rank has been retired and is awaiting shutdown."}'


def status_body(**fields: Any) -> bytes:
    body = {"is_scaling_elastic_ep": False, "phase": "idle", "epoch": None, "error": None,
            "requested_data_parallel_size": None, **fields}  # fmt: skip
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("fields", "verdict"),
    [
        ({"is_scaling_elastic_ep": True, "phase": "committing", "epoch": 1}, ElasticVerdict.SCALING),
        ({"is_scaling_elastic_ep": False, "phase": "preparing"}, ElasticVerdict.SCALING),
        ({"phase": "failed", "error": "barrier timed out"}, ElasticVerdict.FAILED),
        ({"phase": "completed", "epoch": 2}, ElasticVerdict.RETIRED),
        ({"phase": "idle"}, ElasticVerdict.RETIRED),
    ],
)
def test_the_033_status_decides_the_verdict(fields: dict[str, Any], verdict: ElasticVerdict) -> None:
    assert parse_status(200, status_body(**fields)).verdict is verdict


def test_the_032_status_has_only_the_flag() -> None:
    status = parse_status(200, b'{"is_scaling_elastic_ep":true}')
    assert (status.scaling, status.phase, status.verdict) == (True, None, ElasticVerdict.SCALING)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (503, SCALING_BODY),  # 0.32 gates the status route itself
        (
            503,
            b'{"error":{"message":"External Elastic EP status is temporarily unavailable","type":"Service '
            b'Unavailable","param":null,"code":503}}',
        ),  # fmt: skip
        (200, b"not json"),
        (200, b"[]"),
        (200, b'{"is_scaling_elastic_ep":"no"}'),
        (404, b'{"detail":"Not Found"}'),
    ],
)
def test_a_status_that_cannot_be_read_is_not_ready(status: int, body: bytes) -> None:
    parsed = parse_status(status, body)
    assert parsed.problem is not None
    assert parsed.verdict is ElasticVerdict.SCALING
    assert "cannot be read" in parsed.describe()


def test_odd_field_types_are_dropped_not_trusted() -> None:
    status = parse_status(200, status_body(phase=3, epoch="7", error=["x"], requested_data_parallel_size=True))
    assert (status.phase, status.epoch, status.error, status.requested_size) == (None, None, None, None)


@pytest.mark.parametrize(
    ("status", "body", "gated"),
    [
        (503, SCALING_BODY, True),
        (503, RETIRED_BODY, True),
        (503, b'{"error":"any words at all"}', True),
        (500, b'{"error":"Failed to fetch pause status: EngineCore encountered an issue."}', False),
        (503, b'{"error":{"message":"x","type":"ServiceUnavailableError","param":null,"code":503}}', False),
        (503, b'{"error":"x","detail":"y"}', False),
        (503, b"", False),
        (200, b'{"is_paused":false}', False),
    ],
)
def test_the_gate_is_told_by_its_status_and_shape(status: int, body: bytes, gated: bool) -> None:
    assert (gate_message(status, body) is not None) is gated


Route = Callable[[str, str], tuple[int, bytes]]


class ScriptedClient(VllmClient):
    """A VllmClient whose HTTP is a function of (method, path), answering in the order the test scripts it."""

    def __init__(self, route: Route) -> None:
        super().__init__(cast(aiohttp.ClientSession, None), "http://vllm", control_timeout_s=1.0)
        self.route = route
        self.paths: list[str] = []

    async def call(self, method: str, path: str, *, query: Iterable[tuple[str, str]] = (), **kwargs: Any) -> Reply:
        self.paths.append(path)
        status, body = self.route(method, path)
        return Reply(status, body, "application/json")


async def test_a_033_scaling_engine_is_observed_from_its_status_not_its_health() -> None:
    def route(method: str, path: str) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b""
        if path == "/is_scaling_elastic_ep":
            return 200, status_body(
                is_scaling_elastic_ep=True, phase="committing", epoch=4, requested_data_parallel_size=2
            )
        return 503, SCALING_BODY

    obs = await ScriptedClient(route).observe()
    assert obs.elastic == ElasticStatus(scaling=True, phase="committing", epoch=4, requested_size=2)
    assert obs.sleeping is None and obs.paused is None


async def test_a_032_engine_gated_at_health_is_scaling_not_dead() -> None:
    client = ScriptedClient(lambda method, path: (503, SCALING_BODY))
    obs = await client.observe()
    assert obs.elastic is not None and obs.elastic.verdict is ElasticVerdict.SCALING
    assert client.paths == ["/health", "/is_scaling_elastic_ep"]


async def test_a_retired_rank_is_confirmed_by_a_second_gated_read() -> None:
    def route(method: str, path: str) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b""
        if path == "/is_scaling_elastic_ep":
            return 200, status_body(phase="completed", epoch=2)
        return 503, RETIRED_BODY

    client = ScriptedClient(route)
    obs = await client.observe()
    assert obs.elastic is not None and obs.elastic.verdict is ElasticVerdict.RETIRED
    assert client.paths.count("/is_paused") == 2


async def test_a_scale_that_ends_between_the_reads_is_not_taken_for_a_retirement() -> None:
    flag_reads = []  # the first two flag reads are gated; by the second look the scale has completed

    def route(method: str, path: str) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b""
        if path == "/is_scaling_elastic_ep":
            return 200, status_body(phase="completed", epoch=1)
        flag_reads.append(path)
        if len(flag_reads) <= 2:
            return 503, SCALING_BODY
        return 200, json.dumps({path.strip("/"): False}).encode()

    obs = await ScriptedClient(route).observe()
    assert obs.elastic is None
    assert (obs.healthy, obs.sleeping, obs.paused) == (True, False, False)
    assert len(flag_reads) == 4


async def test_a_dead_engines_503_health_is_not_the_gate() -> None:
    obs = await ScriptedClient(lambda method, path: (503, b"")).observe()
    assert obs.elastic is None and not obs.healthy and obs.reachable
