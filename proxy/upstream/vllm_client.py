"""`VllmClient`: typed calls to vLLM's control endpoints, and the one place where aiohttp's client
errors become `UpstreamError`s.

Every call has a deadline. vLLM itself puts none on its lifecycle awaits (a `/sleep?mode=wait` drains
for as long as generations run), so the coordinator passes a long one for lifecycle calls and a short
one for the flag reads used by verification and the reconcile loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from ..errors import UpstreamBadStatus, UpstreamRejected, UpstreamTimeout, UpstreamUnreachable
from .elastic_ep import ElasticStatus, ElasticVerdict, gate_message, parse_status
from .failures import transport_failure
from .observation import Observation, parse_sleep_state


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str | None

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def message(self) -> str:
        """vLLM's error message from either of its two body shapes, else the raw text."""
        try:
            payload = self.json()
        except ValueError:
            return self.body.decode(errors="replace")[:500]
        if isinstance(payload, dict):
            err = payload.get("error", payload.get("detail"))
            if isinstance(err, dict):
                return str(err.get("message", err))
            if err is not None:
                return str(err)
        return self.body.decode(errors="replace")[:500]


class VllmClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, control_timeout_s: float) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        # host:port, for errors a person reads (never the URL's password: they reach logs and /lifeguard/state)
        self._address = yarl.URL(self.base_url).host_port_subcomponent or "vLLM"
        self._control_timeout_s = control_timeout_s
        # Calls no process answered (refused, or reset before any answer): as far as anyone can tell, nothing served
        # at vLLM's address then, whatever call met it. A late answer (UpstreamTimeout) is no such sign.
        self.unanswered_calls = 0

    async def call(
        self,
        method: str,
        path: str,
        *,
        query: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
        json_body: Any = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One request; raises UpstreamUnreachable or UpstreamTimeout, never aiohttp's errors."""
        timeout = timeout_s if timeout_s is not None else self._control_timeout_s
        data: bytes | None = body
        hdrs = dict(headers or {})
        if json_body is not None:
            data = json.dumps(json_body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        try:
            async with asyncio.timeout(timeout):
                async with self.session.request(
                    method, self.base_url + path, params=list(query), data=data, headers=hdrs, allow_redirects=False
                ) as resp:
                    payload = await resp.read()
                    return Reply(resp.status, payload, resp.headers.get("Content-Type"))
        except TimeoutError:
            late = UpstreamTimeout(f"vLLM did not answer {method} {path} within {timeout:g} s")
            late.why = f"no answer to {method} {path} within {timeout:g} s"
            raise late from None
        except (aiohttp.ClientError, OSError) as exc:
            self.unanswered_calls += 1
            why = transport_failure(exc, self._address)
            lost = UpstreamUnreachable(f"vLLM could not be reached for {method} {path}: {why}")
            lost.why = why
            raise lost from exc

    async def lifecycle(self, method: str, path: str, **kwargs: Any) -> Reply:
        """A lifecycle call that must succeed: a non-2xx answer becomes UpstreamBadStatus."""
        # uvicorn closes the socket after an unhandled 500 without saying so; a pooled connection reused
        # after it resets, and aiohttp only retries idempotent methods. These calls are rare: no reuse.
        kwargs["headers"] = {**(kwargs.get("headers") or {}), "Connection": "close"}
        reply = await self.call(method, path, **kwargs)
        if 400 <= reply.status < 500:
            # vLLM refused the call before acting on it (validation, a missing route): the client's error.
            raise UpstreamRejected(
                f"vLLM answered {path} with {reply.status}: {reply.message()}",
                upstream_status=reply.status,
                body=reply.body,
                content_type=reply.content_type,
            )
        if not 200 <= reply.status < 300:
            raise _bad_status(path, reply)
        return reply

    async def health(self) -> bool:
        return (await self.call("GET", "/health")).status == 200

    async def flag(self, path: str, name: str) -> bool | None:
        """`/is_sleeping` or `/is_paused`; None when this vLLM does not serve the route."""
        return _flag(await self.call("GET", path), path, name)

    async def observe(self) -> Observation:
        """Read `/health`, `/is_sleeping` and `/is_paused` (vLLM answers these without an engine round-trip
        for health; the flags wait behind a running sleep/wake on the engine-core thread). When vLLM's elastic-EP
        gate answers instead, what `/is_scaling_elastic_ep` says (proxy/upstream/elastic_ep.py)."""
        try:
            health = await self.call("GET", "/health")
            gated = gate_message(health.status, health.body) is not None  # vLLM 0.32 gates /health too
            if health.status != 200 and not gated:
                return Observation(reachable=True, healthy=False)
            flags = None if gated else await self._flag_replies()
            if flags is None or _gated(*flags):
                status = await self.elastic_status()
                if status.verdict is not ElasticVerdict.RETIRED:
                    return Observation(reachable=True, healthy=health.status == 200, elastic=status)
                # A scale that ended between the flag read and the status read is not a retirement: look once more.
                flags = await self._flag_replies()
                if _gated(*flags):
                    return Observation(reachable=True, healthy=health.status == 200, elastic=status)
            sleeping = _flag(flags[0], "/is_sleeping", "is_sleeping")
            paused = _flag(flags[1], "/is_paused", "is_paused")
        except UpstreamTimeout as exc:
            return Observation(reachable=False, timed_out=True, error=exc.message, why=exc.why)
        except UpstreamUnreachable as exc:
            return Observation(reachable=False, error=exc.message, why=exc.why)
        except UpstreamBadStatus as exc:
            return Observation(reachable=True, healthy=False, error=exc.message)
        awake, level = None, None
        if sleeping:
            awake, level = await self.sleep_state()
        checkpoint, checkpoint_error = await self.checkpoint_state() if sleeping or paused else (None, None)
        return Observation(
            reachable=True, healthy=True, sleeping=sleeping, paused=paused, metric_awake=awake, metric_level=level,
            checkpoint=checkpoint, checkpoint_error=checkpoint_error,
        )  # fmt: skip

    async def checkpoint_state(self) -> tuple[str | None, str | None]:
        """(state, error) from vLLM 0.34's `GET /checkpoint/status` (200 when prepared, 500 when failed, else 503,
        each with `{"state", "error"}`); (None, None) where it is not served or cannot be read."""
        try:
            reply = await self.call("GET", "/checkpoint/status")
            payload = reply.json() if reply.status in (200, 500, 503) else None
        except (UpstreamUnreachable, UpstreamTimeout, ValueError):
            return None, None
        if not isinstance(payload, dict) or not isinstance(payload.get("state"), str):
            return None, None
        error = payload.get("error")
        return payload["state"], str(error) if error is not None else None

    async def _flag_replies(self) -> tuple[Reply, Reply]:
        sleeping, paused = await asyncio.gather(self.call("GET", "/is_sleeping"), self.call("GET", "/is_paused"))
        return sleeping, paused

    async def elastic_status(self) -> ElasticStatus:
        """`POST /is_scaling_elastic_ep`, parsed; an answer that cannot be read is a status with its `problem`."""
        reply = await self.call("POST", "/is_scaling_elastic_ep")
        return parse_status(reply.status, reply.body)

    async def sleep_state(self) -> tuple[bool | None, int | None]:
        try:
            reply = await self.call("GET", "/metrics")
        except (UpstreamUnreachable, UpstreamTimeout):
            return None, None
        return parse_sleep_state(reply.body) if reply.status == 200 else (None, None)


def _gated(*replies: Reply) -> bool:
    return any(gate_message(reply.status, reply.body) is not None for reply in replies)


def _flag(reply: Reply, path: str, name: str) -> bool | None:
    if reply.status == 404:
        return None
    if reply.status != 200:
        raise _bad_status(path, reply)
    value = (reply.json() or {}).get(name)
    return bool(value) if value is not None else None


def _bad_status(path: str, reply: Reply) -> UpstreamBadStatus:
    return UpstreamBadStatus(
        f"vLLM answered {path} with {reply.status}: {reply.message()}",
        upstream_status=reply.status,
        upstream_body=reply.body.decode(errors="replace")[:2000],
    )
