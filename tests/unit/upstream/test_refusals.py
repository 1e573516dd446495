"""proxy/upstream/refusals.py: vLLM's refusals of a forwarded request that the proxy must hold again, not relay.

The bytes are vLLM 0.33's, as its code paths write them (read in the wheel; tests/vllm/test_vllm_refusals.py makes
them with vLLM's own serializers): create_error_response + starlette's compact JSONResponse for a non-streaming
request, json.dumps' default separators for a completions stream, pydantic's compact dump (type
"InternalServerError", code 503) for a chat stream. And the other answers that look alike and are not refusals.
"""

from __future__ import annotations

import pytest

from proxy.upstream.refusals import (
    MAX_FIRST_EVENT_BYTES,
    Pending,
    Refusal,
    RefusalKind,
    response_refusal,
    stream_refusal,
)

JSON = [(b"content-type", b"application/json"), (b"content-length", b"120")]
SSE = [(b"Content-Type", b"text/event-stream; charset=utf-8"), (b"transfer-encoding", b"chunked")]
MESSAGE = "Generation is paused. Please retry after it resumes."

PAUSED_BODY = (
    b'{"error":{"message":"Generation is paused. Please retry after it resumes.",'
    b'"type":"ServiceUnavailableError","param":null,"code":503}}'
)
COMPLETION_STREAM = (
    b'data: {"error": {"message": "Generation is paused. Please retry after it resumes.", '
    b'"type": "ServiceUnavailableError", "param": null, "code": 503}}\n\ndata: [DONE]\n\n'
)
CHAT_STREAM = (
    b'data: {"error":{"message":"Generation is paused. Please retry after it resumes.",'
    b'"type":"InternalServerError","param":null,"code":503}}\n\ndata: [DONE]\n\n'
)
PAUSED = Refusal(RefusalKind.ENGINE_PAUSED, MESSAGE)


def test_vllm_033s_paused_answer_to_a_request_is_a_refusal() -> None:
    assert response_refusal(503, JSON, PAUSED_BODY) == PAUSED


@pytest.mark.parametrize("stream", [COMPLETION_STREAM, CHAT_STREAM])
def test_a_stream_that_opens_with_vllm_033s_paused_event_is_a_refusal(stream: bytes) -> None:
    assert stream_refusal(200, SSE, stream) == PAUSED
    first_event_only = stream.split(b"data: [DONE]")[0]
    assert stream_refusal(200, SSE, first_event_only) == PAUSED  # no need to wait for [DONE]


def test_a_stream_cut_before_its_first_event_ends_asks_for_more() -> None:
    assert stream_refusal(200, SSE, COMPLETION_STREAM[:40]) is Pending.MORE
    assert stream_refusal(200, SSE, b"") is Pending.MORE


def test_keep_alive_comments_before_the_first_event_are_skipped() -> None:
    assert stream_refusal(200, SSE, b": keep-alive\n\n" + CHAT_STREAM) == PAUSED
    assert stream_refusal(200, SSE, b": keep-alive\n\n") is Pending.MORE


def test_crlf_framed_events_are_read_too() -> None:
    assert stream_refusal(200, SSE, COMPLETION_STREAM.replace(b"\n", b"\r\n")) == PAUSED


@pytest.mark.parametrize(
    "first",
    [
        # a completion's first token
        b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
        b'"text":" the","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n',
        # the chat stream's opening role chunk
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n',
        # a stream that failed for another reason: GenerationError (500), an engine death (500)
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
        b'"code": 500}}\n\n',
        # the queue limit's refusal inside a stream: a GracefulHTTPError, typed with the status's phrase
        b'data: {"error": {"message": "The engine is currently busy and cannot accept new requests. Please try '
        b'again later or on a different instance.", "type": "Service Unavailable", "param": null, "code": 503}}\n\n',
        b"data: [DONE]\n\n",
        b"data: not json\n\n",
    ],
)
def test_a_stream_that_opens_otherwise_is_relayed(first: bytes) -> None:
    assert stream_refusal(200, SSE, first + b"data: [DONE]\n\n") is None


def test_a_first_event_longer_than_the_refusal_can_be_is_not_held_back_forever() -> None:
    long_event = b"data: " + b"x" * MAX_FIRST_EVENT_BYTES
    assert stream_refusal(200, SSE, long_event) is None


@pytest.mark.parametrize(
    ("status", "headers"),
    [(503, SSE), (200, JSON), (200, [(b"content-type", b"application/x-ndjson")]), (200, [])],
)
def test_only_a_200_event_stream_is_looked_into(status: int, headers: list[tuple[bytes, bytes]]) -> None:
    assert stream_refusal(status, headers, CHAT_STREAM) is None


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # the message text is never what decides: a paused envelope with another message is still the refusal...
        (
            503,
            b'{"error":{"message":"Generation is paused (reworded).","type":"ServiceUnavailableError",'
            b'"param":null,"code":503}}',
        ),
    ],
)
def test_the_refusal_is_told_by_status_type_and_code_not_by_message_text(status: int, body: bytes) -> None:
    refusal = response_refusal(status, JSON, body)
    assert refusal is not None and refusal.kind is RefusalKind.ENGINE_PAUSED


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # ...and vLLM's own message on another status or type is not it
        (500, PAUSED_BODY),
        (503, PAUSED_BODY.replace(b"ServiceUnavailableError", b"Service Unavailable")),  # the queue limits' 503
        (503, PAUSED_BODY.replace(b'"code":503', b'"code":500')),
        # the proxy's own 503 (it has an X-Lifeguard-Reason and a reason field): never vLLM's refusal
        (
            503,
            b'{"error":{"message":"held 300 s","type":"ServiceUnavailableError","param":null,"code":503,'
            b'"reason":"hold_timeout"}}',
        ),
        (503, b'{"detail":"External Elastic EP status is temporarily unavailable"}'),
        (503, b"<html>Service Unavailable</html>"),
        (503, b""),
        (200, b'{"error":"This data-parallel rank has been retired and is awaiting shutdown."}'),
    ],
)
def test_answers_that_only_look_like_a_refusal_are_relayed(status: int, body: bytes) -> None:
    assert response_refusal(status, JSON, body) is None


@pytest.mark.parametrize(
    "message",
    [
        "The model is currently scaling. Please try again later.",
        "This data-parallel rank has been retired and is awaiting shutdown.",
        "worded any other way",
    ],
)
def test_the_elastic_ep_gates_plain_503_is_a_refusal_whatever_it_says(message: str) -> None:
    body = ('{"error":"' + message + '"}').encode()
    assert response_refusal(503, JSON, body) == Refusal(RefusalKind.ELASTIC_EP, message)


def test_a_refusal_needs_vllms_json_content_type() -> None:
    assert response_refusal(503, [(b"content-type", b"text/plain")], PAUSED_BODY) is None
    assert response_refusal(503, [(b"Content-Type", b"application/json; charset=utf-8")], PAUSED_BODY) == PAUSED
