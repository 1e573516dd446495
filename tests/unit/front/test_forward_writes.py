"""proxy/front/exchange.py's `Forward` on a proxy/upstream/pool.py connection, driven read by read without sockets:
what one read of vLLM's yields for the client goes out in one write (docs/performance.md, issue 39), in order. The
tests are async: a connection released to its pool keeps it on the running loop."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from proxy.front.exchange import Exchange, Forward
from proxy.front.request_reader import ParsedRequest
from proxy.lifecycle.engine import Engine
from proxy.lifecycle.gate import RequestGate
from proxy.lifecycle.inflight import InFlightRequests
from proxy.lifecycle.rules import Admission
from proxy.lifecycle.weight_version import WeightVersions
from proxy.observe.version_metrics import EngineVersionMetrics
from proxy.upstream.pool import UpstreamConnection, UpstreamPool

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices": [{"text": "%d"}]}\n\n' % n for n in range(4)]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


class _Client:
    def __init__(self) -> None:
        self.transport = _Transport()
        self.writing_paused = False
        self.done: list[Exchange] = []

    def exchange_done(self, exchange: Exchange, *, close: bool) -> None:
        self.done.append(exchange)


def _pool() -> UpstreamPool:
    """A real pool (the compiled build checks the type) that never connects: the connection comes in by hand."""

    async def connect(factory: Callable[[], UpstreamConnection]) -> Any:
        raise AssertionError("the test hands the pool its connection")

    return UpstreamPool(
        connect, max_connections=1, max_connecting=1, keepalive_s=60, connect_timeout_s=1, name="t", address="vllm:8000"
    )


def _engine() -> Engine:
    quiet = SimpleNamespace(
        upstream_latency=lambda seconds: None,
        request_duration=lambda route_class, seconds: None,
        inference_finished=lambda outcome, seconds: None,
        versions=SimpleNamespace(request_ended=lambda lag, tokens: None),
    )
    upstream = SimpleNamespace(host=b"vllm:8000", basic_auth=None, origins=(), pool=None)
    versions = WeightVersions(cast(EngineVersionMetrics, SimpleNamespace(generation=lambda g: None)), lambda: None)
    coordinator = SimpleNamespace(record=SimpleNamespace(prefix_partition=None))
    engine = SimpleNamespace(
        name="default", metrics=quiet, upstream=upstream, inflight=InFlightRequests(), coordinator=coordinator,
        versions=versions,
    )  # fmt: skip
    return cast(Engine, engine)


def _request() -> ParsedRequest:
    request = ParsedRequest()
    request.method, request.url = b"POST", b"/v1/completions"
    request.headers = [(b"Host", b"x"), (b"Content-Type", b"application/json")]
    request.body = [b'{"model": "tiny", "prompt": "hi", "stream": true}']
    request.complete = True
    return request


def _forwarded(*, inference: bool) -> tuple[_Client, UpstreamConnection, _Transport]:
    """A `Forward` that sent its request on a fresh connection: the client, the connection, vLLM's side of it."""
    client = _Client()
    ticket = None
    if inference:
        gate = RequestGate(max_held=1, hold_timeout_s=1)
        gate.set_admission(Admission.FORWARD)
        ticket = gate.try_admit()
        assert ticket is not None
    forward = Forward(cast(Any, client), _request(), _engine(), b"/v1/completions", ticket=ticket)
    conn = UpstreamConnection(_pool())
    upstream = _Transport()
    conn.connection_made(cast(Any, upstream))
    forward.connected(conn)
    assert upstream.writes and upstream.writes[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    return client, conn, upstream


@pytest.mark.parametrize("inference", [False, True], ids=["pass-through", "inference, its refusal probe"])
async def test_one_read_of_vllms_with_the_head_and_several_events_is_one_write_to_the_client(inference: bool) -> None:
    client, conn, _ = _forwarded(inference=inference)
    conn.data_received(SSE_HEAD + b"".join(_chunk(event) for event in EVENTS[:3]))
    assert len(client.transport.writes) == 1
    head, _, body = client.transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head
    assert body == b"".join(_chunk(event) for event in EVENTS[:3])


async def test_the_last_events_and_the_end_of_the_stream_are_one_write_and_come_before_the_exchange_ends() -> None:
    client, conn, _ = _forwarded(inference=True)
    conn.data_received(SSE_HEAD + _chunk(EVENTS[0]))
    conn.data_received(_chunk(EVENTS[1]) + _chunk(EVENTS[2]))
    assert len(client.transport.writes) == 2 and not client.done
    conn.data_received(_chunk(EVENTS[3]) + b"0\r\n\r\n")
    assert len(client.transport.writes) == 3 and len(client.done) == 1
    assert client.transport.writes[2] == _chunk(EVENTS[3]) + b"0\r\n\r\n"


async def test_a_head_without_its_first_event_is_kept_back_and_goes_out_with_it_in_one_write() -> None:
    client, conn, _ = _forwarded(inference=True)
    conn.data_received(SSE_HEAD)
    assert client.transport.writes == []  # it might still be vLLM's refusal
    conn.data_received(_chunk(EVENTS[0]))
    assert len(client.transport.writes) == 1
    assert client.transport.writes[0].endswith(b"\r\n\r\n" + _chunk(EVENTS[0]))


async def test_what_a_read_gathered_goes_out_before_the_error_event_of_an_upstream_that_broke_in_it() -> None:
    client, conn, _ = _forwarded(inference=False)
    conn.data_received(SSE_HEAD + _chunk(EVENTS[0]) + b"not a chunk size\r\n")
    written = b"".join(client.transport.writes)
    assert written.index(_chunk(EVENTS[0])) < written.index(b"stream_broken") and len(client.done) == 1
