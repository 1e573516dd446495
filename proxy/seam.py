"""The seam between the raw front and the aiohttp application: where one hands requests to the other.

`data_plane: raw` runs the proxy as two listeners in one process. The public socket is the raw front
(proxy/front.py): it forwards inference to vLLM itself while the gate admits at once. Every other request
(lifecycle and control calls, `/lifeguard/*`, metrics, pass-through routes: all but inference) is
relayed byte for byte to the unchanged aiohttp application (proxy/app.py), which this module serves on
unix socket pairs: each connection the front opens to it is a `socket.socketpair()` whose other end is
handed to the application as an accepted connection. There is no listening socket, so no accept queue a
burst of connects can overflow (a full one made asyncio hand over an unconnected socket, cut on its
first write) and nothing on disk. The application answers exactly as it did when it listened itself;
the front relays that answer back on the client's connection.

Shutdown: the public socket stops accepting; then, side by side, the application shuts down as before
(held requests, the front's parked ones too, 503 `shutting_down`; its handlers get `shutdown_grace_s`)
and the front waits up to
`shutdown_grace_s` for its own exchanges; then both upstream pools close.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import Callable

from aiohttp import web
from yarl import URL

from .config import Settings
from .exchange import Upstreams
from .front import Front
from .handlers import COORDINATOR, GATE, INFLIGHT, METRICS, ROUTES
from .upstream_pool import Connection, UpstreamConnection, UpstreamPool

# The front holds one connection to the application per client connection at most; the application's
# own limits (max_held_requests ...) are what bound them.
_SEAM_MAX_CONNECTIONS = 1 << 20
_SEAM_KEEPALIVE_S = 60.0


class RawDataPlane:
    """The raw front on the public socket, the aiohttp application behind it on a private one."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        if settings.upstream is None:
            raise ValueError("the raw data plane needs settings.upstream")
        self.app = app
        self._settings = settings
        self.runner = web.AppRunner(
            app,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=settings.shutdown_grace_s,
            # The client's header deadline is the front's; the front's own idle connections expire first.
            keepalive_timeout=_SEAM_KEEPALIVE_S * 2,
        )
        self._server: asyncio.Server | None = None
        self.front: Front | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self, host: str, port: int, *, backlog: int = 4096, sock: socket.socket | None = None) -> None:
        """Start the application, then listen on `host:port` (or on `sock`)."""
        settings = self._settings
        await self.runner.setup()
        app_server = self.runner.server
        assert app_server is not None
        loop = asyncio.get_running_loop()
        upstream = URL(settings.upstream or "")
        vllm_host, vllm_port = upstream.raw_host, upstream.port
        if vllm_host is None or vllm_port is None:
            raise ValueError(f"cannot read a host and port in {settings.upstream_shown!r}")
        host_header = vllm_host
        if not upstream.is_default_port():
            host_header += f":{upstream.port}"
        basic = None
        if upstream.user:
            # what aiohttp's client sends for credentials in the URL
            basic = b"Basic " + base64.b64encode(f"{upstream.user}:{upstream.password or ''}".encode("latin-1"))
        origin = upstream.origin()

        async def to_vllm(factory: Callable[[], UpstreamConnection]) -> Connection:
            return await loop.create_connection(
                factory,
                vllm_host,
                vllm_port,
                ssl=upstream.scheme == "https" or None,
            )

        async def to_app(factory: Callable[[], UpstreamConnection]) -> Connection:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await loop.connect_accepted_socket(app_server, theirs)
            except BaseException:
                ours.close()
                theirs.close()
                raise
            try:
                return await loop.create_unix_connection(factory, sock=ours)
            except BaseException:
                ours.close()
                raise

        app = self.app
        upstreams = Upstreams(
            vllm=UpstreamPool(
                to_vllm,
                max_connections=settings.upstream_max_connections,
                keepalive_s=settings.upstream_keepalive_s,
                connect_timeout_s=settings.connect_timeout_s,
                name="vllm",
            ),
            seam=UpstreamPool(
                to_app,
                max_connections=_SEAM_MAX_CONNECTIONS,
                keepalive_s=_SEAM_KEEPALIVE_S,
                connect_timeout_s=settings.connect_timeout_s,
                name="app",
            ),
            host=host_header.encode("latin-1"),
            basic_auth=basic,
            origins=(str(origin), f"{origin.scheme}://{origin.raw_host}:{origin.port}"),
            inflight=app[INFLIGHT],
            metrics=app[METRICS],
        )
        self.front = Front(settings, app[ROUTES], app[GATE], app[COORDINATOR], upstreams)
        if sock is not None:
            self._server = await loop.create_server(self.front.protocol, sock=sock, backlog=backlog)
        else:
            self._server = await loop.create_server(self.front.protocol, host, port, backlog=backlog)

    async def close(self) -> None:
        """Stop accepting, shut the application down and let the front's exchanges finish (both within
        `shutdown_grace_s`), then close every connection."""
        if self._server is not None:
            self._server.close()
        front = self.front
        if front is not None:
            await asyncio.gather(self.runner.cleanup(), front.drain(self._settings.shutdown_grace_s))
            await front.upstreams.vllm.close()
            await front.upstreams.seam.close()
        else:
            await self.runner.cleanup()
