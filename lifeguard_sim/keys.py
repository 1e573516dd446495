"""Typed application keys shared by the app and its route modules."""

from __future__ import annotations

from aiohttp import web

from lifeguard_sim.engine import Engine


class LiveRequests:
    """The requests being answered right now, so a simulated process death can reset them all."""

    def __init__(self) -> None:
        # Keyed by id(): aiohttp requests are mutable mappings, hence unhashable.
        self._requests: dict[int, web.BaseRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: web.BaseRequest) -> None:
        self._requests[id(request)] = request

    def discard(self, request: web.BaseRequest) -> None:
        self._requests.pop(id(request), None)

    def reset_all(self) -> None:
        for request in list(self._requests.values()):
            reset_connection(request)


def reset_connection(request: web.BaseRequest) -> None:
    """What a caller sees when the server process dies: the TCP connection is reset, no answer."""
    transport = request.transport
    if transport is not None:
        transport.abort()


SIM_ENGINE = web.AppKey("sim_engine", Engine)
LIVE_REQUESTS = web.AppKey("sim_live_requests", LiveRequests)
