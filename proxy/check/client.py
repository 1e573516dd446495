"""HTTP for the check: every call has a deadline, and a call that fails is a `Reply` saying how, never an
exception, so a row records a hang or a crash as evidence instead of dying of it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import aiohttp
import yarl

from ..upstream.failures import transport_failure

#: The header the lifeguard reads its admin token from.
TOKEN_HEADER = "X-Lifeguard-Token"
#: The deadline of one call unless the caller gives its own: lifecycle calls on a loaded CPU take seconds.
CALL_TIMEOUT_S = 30.0


@dataclass
class Reply:
    """What came back: ``status`` is None when nothing did (``failure`` says why: no answer in time, refused,
    reset)."""

    method: str
    path: str
    status: int | None
    body: Any = None
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def hung(self) -> bool:
        return self.failure is not None and self.failure.startswith("no answer")

    def summary(self) -> str:
        """One line for a report: the status (or the failure) and the body, short."""
        if self.status is None:
            return str(self.failure)
        shown = self.text.strip().replace("\n", " ")
        return f"{self.status} {shown[:160]}{'…' if len(shown) > 160 else ''}".strip()

    def evidence(self) -> dict[str, Any]:
        lifeguard_headers = {k: v for k, v in self.headers.items() if k.lower().startswith("x-lifeguard")}
        return {
            "sent": f"{self.method} {self.path}",
            "status": self.status,
            "body": self.text[:400],
            "headers": lifeguard_headers,
            "seconds": round(self.seconds, 3),
            "failure": self.failure,
        }


class Http:
    """One base URL (a vLLM or a lifeguard); ``token`` goes in the lifeguard's admin header when set."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, token: str | None = None, timeout: float = CALL_TIMEOUT_S
    ) -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.address = yarl.URL(self.base).host_port_subcomponent or self.base  # for errors a person reads
        self.token = token
        self.timeout = timeout  # the deadline of a call that does not name its own

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: list[tuple[str, str]] | dict[str, str] | None = None,
        json_body: Any = None,
        timeout: float | None = None,
        token: bool = True,
        first_bytes: asyncio.Event | None = None,
    ) -> Reply:
        """`first_bytes`: set when the answer's body begins (a stream's first event: vLLM is running it)."""
        timeout = self.timeout if timeout is None else timeout
        shown = path + ("?" + urlencode(params) if params else "")
        headers = {TOKEN_HEADER: self.token} if self.token and token else {}
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                async with self.session.request(
                    method, self.base + path, params=params, json=json_body, headers=headers
                ) as resp:
                    if first_bytes is None:
                        text = await resp.text(errors="replace")
                    else:
                        chunks = []
                        async for chunk in resp.content.iter_any():
                            first_bytes.set()
                            chunks.append(chunk)
                        text = b"".join(chunks).decode(resp.get_encoding(), errors="replace")
                    return Reply(method, shown, resp.status, _json(text), text, dict(resp.headers), _since(started))
        except TimeoutError:
            return Reply(method, shown, None, seconds=_since(started), failure=f"no answer within {timeout:g} s")
        except aiohttp.ClientConnectorError as exc:  # refused, DNS, TLS: each reads apart
            return Reply(method, shown, None, seconds=_since(started), failure=transport_failure(exc, self.address))
        except (aiohttp.ClientError, OSError) as exc:
            lost = f"connection lost: {transport_failure(exc, self.address)}"
            return Reply(method, shown, None, seconds=_since(started), failure=lost)

    async def get(self, path: str, *, timeout: float | None = None, token: bool = True) -> Reply:
        return await self.call("GET", path, timeout=timeout, token=token)

    async def post(self, path: str, timeout: float | None = None, **params: str) -> Reply:
        return await self.call("POST", path, params=params or None, timeout=timeout)


def _json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _since(started: float) -> float:
    return time.monotonic() - started
