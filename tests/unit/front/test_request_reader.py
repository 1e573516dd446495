"""The request reader lets llhttp's parser go between keep-alive requests and reads on as before."""

from __future__ import annotations

from proxy.errors import BadRequest
from proxy.front.request_reader import ParsedRequest, RequestReader

KEEP = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
CLOSE = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"


def reader() -> tuple[RequestReader, list[ParsedRequest]]:
    heads: list[ParsedRequest] = []
    return RequestReader(heads.append), heads


def test_rest_between_keep_alive_requests_reads_the_next_one() -> None:
    r, heads = reader()
    assert r._parser is None  # an open connection has none until bytes arrive
    assert r.feed(KEEP) is None
    r.rest()
    assert r._parser is None
    assert r.feed(KEEP[:30]) is None
    r.rest()  # a request half read keeps its parser
    assert r._parser is not None
    assert r.feed(KEEP[30:] + KEEP) is None
    assert [(h.method, h.url, h.complete, h.body) for h in heads] == [(b"POST", b"/v1/completions", True, [b"{}"])] * 3


def test_rest_after_connection_close_keeps_the_parser_and_its_refusal() -> None:
    r, heads = reader()
    assert r.feed(CLOSE) is None
    r.rest()
    assert r._parser is not None
    assert isinstance(r.feed(KEEP), BadRequest)  # llhttp: data after `Connection: close`
    assert len(heads) == 1
