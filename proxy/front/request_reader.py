"""Reading requests off a client connection with llhttp: one `ParsedRequest` each, and what is refused first.

llhttp refuses the request-smuggling shapes itself (400 `bad_request`). Added here, aiohttp's limits: a target over
8190 bytes (414), a header line over 8190 bytes, more than 128 headers or a head over 64 KiB (431), and an
HTTP/1.1 request without Host (400). Every refusal ends the connection: what follows cannot be trusted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import httptools

from ..errors import BadRequest, HeadersTooLarge, LifeguardError, TargetTooLong

if TYPE_CHECKING:
    from .routing import Route

MAX_TARGET = 8190
MAX_HEADER_LINE = 8190
MAX_HEADERS = 128
MAX_HEAD = 64 * 1024

# Shared instead of one copy per held request (issue 21, `ParsedRequest.compact`): no tokens, and the header names
# (as sent) and the Host and Content-Type values that nearly every request repeats; values while the table has room.
_NO_TOKENS: frozenset[bytes] = frozenset()
_NAMES = {
    name: name
    for common in (
        b"Host",
        b"Content-Type",
        b"Content-Length",
        b"User-Agent",
        b"Accept",
        b"Accept-Encoding",
        b"Authorization",
        b"Connection",
        b"X-Request-Id",
        b"Transfer-Encoding",
        b"Expect",
    )  # fmt: skip
    for name in (common, common.lower())
}
_SHARED_VALUE_NAMES = frozenset({b"host", b"content-type"})
_SHARED_VALUES: dict[bytes, bytes] = {}
_SHARED_VALUES_MAX = 256
_SHARED_VALUE_LEN = 128


# What the reader notes of a field, by its name: looked up as sent (the spellings clients send), else lowered.
_ORDINARY, _HOST, _LENGTH, _CHUNKED, _CONNECTION, _EXPECT = (object() for _ in range(6))
_KIND = {
    b"host": _HOST,
    b"content-length": _LENGTH,
    b"transfer-encoding": _CHUNKED,
    b"connection": _CONNECTION,
    b"expect": _EXPECT,
}
_KIND_AS_SENT = {
    **_KIND,
    **{b"-".join(part.capitalize() for part in name.split(b"-")): kind for name, kind in _KIND.items()},
    **{name: _ORDINARY for name in _NAMES if name.lower() not in _KIND},
}


class _Refused(Exception):
    """Raised from a parser callback to stop llhttp; the error to answer is on the connection."""


class ParsedRequest:
    """One request as llhttp read it; `body` holds the pieces not yet relayed."""

    __slots__ = (
        "method",
        "url",
        "version",
        "headers",
        "keep_alive",
        "chunked",
        "content_length",
        "connection_tokens",
        "expect_continue",
        "head_done",
        "started",
        "head_size",
        "host",
        "body",
        "body_size",
        "complete",
        "error",
        "route",
        "drop",
        "reholds",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.chunked = False
        self.content_length: int | None = None
        self.connection_tokens = _NO_TOKENS
        self.expect_continue = False
        self.head_done = False
        self.started = 0.0  # time.monotonic() when the head was complete, as the aiohttp handler began
        self.head_size = 0
        self.host = False
        self.body: list[bytes] = []
        self.body_size = 0
        self.complete = False
        self.error: LifeguardError | None = None
        self.route: Route | None = None  # where it goes (proxy/front/routing.py), decided when its head is read
        self.drop = _NO_TOKENS  # the header that carried the admin token, never forwarded
        self.reholds = 0  # how often vLLM refused it for the engine's own state and it went back to the gate

    def compact(self) -> None:
        """Share the header names and the Host and Content-Type values that nearly every request repeats, for a
        request that is going to wait (held: issue 21); not on the way of one forwarded at once."""
        headers = self.headers
        for index, (name, value) in enumerate(headers):
            shared_name = _NAMES.get(name, name)
            if shared_name.lower() in _SHARED_VALUE_NAMES and len(value) <= _SHARED_VALUE_LEN:
                shared = _SHARED_VALUES.get(value)
                if shared is not None:
                    value = shared
                elif len(_SHARED_VALUES) < _SHARED_VALUES_MAX:
                    _SHARED_VALUES[value] = value
            headers[index] = (shared_name, value)

    def whole_body(self) -> bytes:
        """The body received, joined once."""
        if len(self.body) > 1:
            self.body[:] = [b"".join(self.body)]
        return self.body[0] if self.body else b""


class RequestReader:
    """Feeds llhttp; hands each request on once its head is complete (`on_head`), then fills in its body."""

    __slots__ = ("_on_head", "_parser", "_parsing", "_head_bytes", "_refusal", "upgraded", "_reusable")

    def __init__(self, on_head: Callable[[ParsedRequest], None]) -> None:
        self._on_head = on_head
        self._parser: httptools.HttpRequestParser | None = None  # made when the first bytes arrive
        self._parsing: ParsedRequest | None = None
        self._reusable = False  # the last request ended where a new parser may start: keep-alive, nothing after
        self._head_bytes = 0
        self._refusal: LifeguardError | None = None
        self.upgraded = False

    def feed(self, data: bytes) -> LifeguardError | None:
        """Parse `data`; the error to answer when the stream of requests cannot be read on."""
        parser = self._parser
        if parser is None:
            parser = self._parser = httptools.HttpRequestParser(self)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol switch through the proxy (Upgrade is hop-by-hop): the request is answered as a plain
            # one, and the connection ends with that answer.
            self.upgraded = True
        except _Refused:
            return self._refusal or BadRequest("the request was refused")
        except httptools.HttpParserCallbackError as exc:
            if self._refusal is not None:
                return self._refusal
            raise exc.__context__ or exc from None  # a bug of ours in a callback (llhttp keeps it as the context)
        except httptools.HttpParserError as exc:
            return BadRequest(f"malformed HTTP/1.1 request: {exc}")
        if self._parsing is not None and not self._parsing.head_done:
            # llhttp keeps a header value that has not ended yet: bounded here, by what was fed meanwhile.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                return HeadersTooLarge(f"the request head exceeds {MAX_HEAD} bytes")
        return None

    def rest(self) -> None:
        """Let llhttp's parser go (~0.9 KB) while the request read last waits (held: issue 21). Only between
        keep-alive requests, where llhttp starts the next one in the state a new parser starts in; made again
        when bytes arrive."""
        if self._reusable and self._parsing is None and not self.upgraded:
            self._parser = None

    # ----- llhttp's callbacks
    # No on_message_begin: one callback less per request. A request's first callback is its target's (on_url).
    def on_url(self, url: bytes) -> None:
        request = self._parsing
        if request is None:
            request = self._parsing = ParsedRequest()
            self._head_bytes = 0
        request.url += url
        if len(request.url) > MAX_TARGET:
            self._stop(TargetTooLong(f"the request target exceeds {MAX_TARGET} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._parsing
        assert request is not None
        headers = request.headers
        size = len(name) + len(value)
        if size + 2 > MAX_HEADER_LINE or len(headers) >= MAX_HEADERS:
            self._stop(HeadersTooLarge(f"a header line exceeds {MAX_HEADER_LINE} bytes, or there are more than "
                                       f"{MAX_HEADERS} headers"))  # fmt: skip
        request.head_size += size + 4
        if request.head_size + len(request.url) > MAX_HEAD:
            self._stop(HeadersTooLarge(f"the request head exceeds {MAX_HEAD} bytes"))
        headers.append((name, value))
        kind = _KIND_AS_SENT.get(name)
        if kind is None:
            kind = _KIND.get(name.lower(), _ORDINARY)
        if kind is _ORDINARY:
            return
        if kind is _HOST:
            request.host = True
        elif kind is _LENGTH:
            request.content_length = int(value)  # llhttp admits digits only, and one Content-Length
        elif kind is _CHUNKED:
            request.chunked = True  # llhttp admits a Transfer-Encoding only when it ends in chunked
        elif kind is _CONNECTION:
            request.connection_tokens |= {token.strip().lower() for token in value.split(b",")}
        elif value.strip().lower() == b"100-continue":  # Expect
            request.expect_continue = True

    def on_headers_complete(self) -> None:
        request = self._parsing
        assert request is not None
        parser = self._parser
        assert parser is not None  # called from its feed_data
        request.method = parser.get_method()
        version = parser.get_http_version()
        request.version = "1.1" if version == "1.1" else version  # one str, not one per request
        request.keep_alive = parser.should_keep_alive()
        request.head_done = True
        request.started = time.monotonic()
        if not request.host and request.version == "1.1":
            self._stop(BadRequest("an HTTP/1.1 request must have a Host header (RFC 9112 §3.2)"))
        self._on_head(request)

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        assert request is not None
        request.body_size += len(body)
        if request.error is None:
            request.body.append(body)

    def on_message_complete(self) -> None:
        request = self._parsing
        assert request is not None
        request.complete = True
        self._reusable = request.keep_alive
        self._parsing = None

    def _stop(self, error: LifeguardError) -> NoReturn:
        self._refusal = error
        raise _Refused
