"""The data plane: one request to vLLM and its answer back, byte for byte.

Headers are copied minus hop-by-hop ones (RFC 9110 §7.6.1, plus those named in `Connection`); nothing
is added upstream (no `X-Forwarded-For`: TRL reads it as the NCCL host). Bodies with a length are
answered with the same length (SkyRL reads a body only when `Content-Length` is set); streams are
relayed chunk by chunk as they arrive, with the client's back-pressure (`write` awaits the drain).
Leaving the upstream `async with` before the body is complete closes that connection, which is what
makes vLLM abort the generation when our client goes away.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from .errors import UpstreamUnreachable
from .inflight import InFlight

log = logging.getLogger("lifeguard.forward")
STREAM_BROKEN = web.RequestKey("stream_broken", bool)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # The proxy's own admin credential: it authorises the call here and is never vLLM's business.
        "x-lifeguard-token",
    }
)


def end_to_end(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], also_drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """A copy of `headers` without hop-by-hop ones, nor the ones listed in `Connection` or `also_drop`
    (lower-case names)."""
    if isinstance(headers, (CIMultiDict, CIMultiDictProxy)):
        # aiohttp's own header maps: a case-insensitive C lookup finds `Connection` without a loop.
        listed: list[str] = headers.getall("Connection", [])
        items: Iterable[tuple[str, str]] = headers.items()
    else:
        items = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
        listed = [value for name, value in items if name.lower() == "connection"]
    drop = HOP_BY_HOP | also_drop if also_drop else HOP_BY_HOP
    if listed:
        drop = drop | {token.strip().lower() for value in listed for token in value.split(",")}
    return CIMultiDict([(name, value) for name, value in items if name.lower() not in drop])


def sse_error_event(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def relative_location(location: str, origins: tuple[str, ...]) -> str:
    """`location` made relative when it points at one of `origins` (vLLM's own address)."""
    for origin in origins:
        if location.startswith(origin) and location[len(origin) : len(origin) + 1] in ("", "/", "?"):
            return location[len(origin) :] or "/"
    return location


_SKIP_AUTO_HEADERS = ("Accept-Encoding", "User-Agent", "Accept", "Content-Type")
_NO_BODY_METHODS = frozenset({"GET", "HEAD"})
_URL_CACHE_SIZE = 256


class Forwarder:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        on_latency: Callable[[float], None] | None = None,
    ) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        origin = URL(self._base).origin()
        self._upstream_origins = (str(origin), f"{origin.scheme}://{origin.raw_host}:{origin.port}")
        self._on_latency = on_latency
        # Parsing the upstream URL is a visible share of a request's cost; inference traffic uses a
        # handful of paths, so the parsed URLs are kept (bounded: query strings make paths unbounded).
        self._urls: dict[str, URL] = {}

    def _url(self, raw_target: str) -> URL:
        url = self._urls.get(raw_target)
        if url is None:
            # encoded=True: the bytes classified (proxy/target.py) are the bytes sent; yarl would otherwise
            # resolve dot segments and re-quote escapes after the decision.
            url = URL(self._base + raw_target, encoded=True)
            if len(self._urls) < _URL_CACHE_SIZE:
                self._urls[raw_target] = url
        return url

    async def forward(
        self,
        request: web.Request,
        raw_target: str,
        body: bytes,
        *,
        extra_headers: Mapping[str, str] | None = None,
        drop_headers: frozenset[str] = frozenset(),
        inflight: InFlight | None = None,
    ) -> web.StreamResponse:
        """Send `request` to vLLM at `raw_target` (origin-form path and query, as classified), with its
        already-read `body`, and relay the answer; `inflight` is told when a stream starts and when vLLM's
        answer is complete."""
        method = request.method
        started = time.monotonic()
        try:
            upstream_cm = self._session.request(
                method,
                self._url(raw_target),
                headers=end_to_end(request.headers, drop_headers),
                data=body if body or method not in _NO_BODY_METHODS else None,
                allow_redirects=False,
                skip_auto_headers=_SKIP_AUTO_HEADERS,
            )
            async with upstream_cm as upstream:
                if self._on_latency is not None:
                    self._on_latency(time.monotonic() - started)
                return await self._relay(request, upstream, extra_headers, inflight)
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise UpstreamUnreachable(f"vLLM could not be reached: {exc}") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            # A TimeoutError is an OSError: unmapped, it escaped as aiohttp's bare 504 (seen when 10,000
            # held requests were released at once and vLLM's accept queue overflowed).
            raise UpstreamUnreachable(f"vLLM did not accept a connection in time: {exc!r}") from exc

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        extra_headers: Mapping[str, str] | None,
        inflight: InFlight | None = None,
    ) -> web.StreamResponse:
        headers = end_to_end(upstream.headers)
        if extra_headers:
            headers.update(extra_headers)
        location = headers.get("Location")
        if location is not None:
            # starlette's redirects (a trailing slash) name vLLM's own address; the client must stay with us.
            headers["Location"] = relative_location(location, self._upstream_origins)
        is_sse = "text/event-stream" in upstream.headers.get("Content-Type", "").lower()
        if upstream.content_length is not None and not is_sse:
            payload = await upstream.read()
            if inflight is not None:
                inflight.finished_upstream()
            return web.Response(status=upstream.status, reason=upstream.reason, body=payload, headers=headers)
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        if inflight is not None:
            inflight.started_stream(response, is_sse=is_sse)
        broke: str | None = None
        try:
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = f"the upstream stream broke: {exc!r}"
                    break
                if not chunk:
                    if inflight is not None:
                        inflight.finished_upstream()
                    break
                await response.write(chunk)
            if broke is not None:
                log.warning("stream from vLLM broke mid-way", extra={"event": "stream_broken"})
                request[STREAM_BROKEN] = True
                if is_sse:
                    await response.write(sse_error_event(broke))
            await response.write_eof()
        except ConnectionResetError:
            # The client left mid-stream: not an error of ours. Leaving here closes the upstream response,
            # which is what makes vLLM abort the generation.
            log.debug("client left mid-stream")
        return response
