"""`Upstream`: what the data plane needs to forward a request to one engine's vLLM."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable

from yarl import URL

from .pool import Connection, UpstreamConnection, UpstreamPool, default_max_connecting


class Upstream:
    """What forwarding a request to one engine's vLLM needs: a keep-alive pool of raw connections, and the
    `Host` and credentials aiohttp's client would have sent for its base URL."""

    def __init__(
        self,
        base_url: str,
        *,
        shown: str | None,
        max_connections: int,
        max_connecting: int | None,
        keepalive_s: float,
        connect_timeout_s: float,
    ) -> None:
        """`shown`: the base URL as errors may show it (no password); `max_connecting` None or 0: the default."""
        url = URL(base_url)
        host, port = url.raw_host, url.port
        if host is None or port is None:
            raise ValueError(f"cannot read a host and port in {shown!r}")
        self.host = (host if url.is_default_port() else f"{host}:{port}").encode("latin-1")
        self.basic_auth = (
            b"Basic " + base64.b64encode(f"{url.user}:{url.password or ''}".encode("latin-1")) if url.user else None
        )
        origin = url.origin()
        # starlette's redirects name vLLM's own address in either form: made relative on the way back.
        self.origins = (str(origin).encode(), f"{origin.scheme}://{origin.raw_host}:{origin.port}".encode())
        tls = url.scheme == "https" or None

        async def connect(factory: Callable[[], UpstreamConnection]) -> Connection:
            return await asyncio.get_running_loop().create_connection(factory, host, port, ssl=tls)

        self.pool = UpstreamPool(
            connect,
            max_connections=max_connections,
            max_connecting=max_connecting or default_max_connecting(),
            keepalive_s=keepalive_s,
            connect_timeout_s=connect_timeout_s,
            name="vllm",
            address=f"{host}:{port}",
        )
