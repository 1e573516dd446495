"""The error tree: one class per reason, so the reasons the proxy answers with are a closed set."""

from __future__ import annotations

import json
import re
import socket
import ssl

import pytest

from proxy.errors import (
    REASONS,
    BadRequest,
    BodyTooLarge,
    HoldTimeout,
    LifeguardError,
    UpstreamRejected,
)
from proxy.front.wire import error_bytes
from proxy.lifecycle.verdict import CheckName, CheckResult
from proxy.observe.metrics import CHECK_RESULTS, CHECKS, HOLD_OUTCOMES
from proxy.upstream.failures import transport_failure


def _tree(cls: type[LifeguardError]) -> list[type[LifeguardError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _tree(child))]


def test_a_reason_is_a_class_attribute_never_an_argument() -> None:
    """`reason=` was a free string at each raise; a typo invented a new X-Lifeguard-Reason and metric label."""
    error = LifeguardError("x")
    assert error.reason == "proxy_error"
    for cls in _tree(LifeguardError):
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", cls.reason), cls
        assert "reason" not in cls.__init__.__code__.co_varnames


def test_each_reason_has_one_status() -> None:
    status: dict[str, int] = {}
    for cls in _tree(LifeguardError):
        if cls.__name__ == "UpstreamRejected":
            continue  # carries vLLM's own 4xx
        assert status.setdefault(cls.reason, cls.status) == cls.status, cls


def test_the_gate_outcomes_are_reasons() -> None:
    assert {"hold_timeout", "hold_queue_full", "shutting_down"} <= REASONS
    assert {"hold_timeout", "hold_queue_full", "shutting_down"} <= set(HOLD_OUTCOMES)


def test_the_metric_label_sets_are_the_verifiers_vocabulary() -> None:
    assert set(CHECKS) == set(CheckName)
    assert set(CHECK_RESULTS) == set(CheckResult)


@pytest.mark.parametrize(
    "error",
    [BodyTooLarge("too big", close_connection=True), HoldTimeout("held too long"), BadRequest("smuggled")],
)
def test_an_error_is_one_whole_response_in_vllms_shape(error: LifeguardError) -> None:
    raw = error_bytes(error)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert lines[0].startswith(f"HTTP/1.1 {error.status} ")
    assert int(headers["Content-Length"]) == len(body)
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    assert headers["X-Lifeguard-Reason"] == error.reason
    assert ("Retry-After" in headers) == (error.status == 503)
    assert ("Connection" in headers) == error.close_connection
    payload = json.loads(body)["error"]
    assert payload["message"] == error.message and payload["code"] == error.status
    assert payload["type"] == error.error_type and payload["reason"] == error.reason and payload["src"] == "lifeguard"
    assert "param" in payload


def test_vllms_own_refusal_goes_out_as_vllm_said_it() -> None:
    refusal = UpstreamRejected("no", upstream_status=422, body=b'{"detail": "bad"}', content_type="application/json")
    head, _, body = error_bytes(refusal).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 422 ") and body == b'{"detail": "bad"}'


@pytest.mark.parametrize(
    ("failure", "words"),
    [
        (ConnectionRefusedError(111, "Connect call failed"), "connection refused by vllm:8000"),
        (socket.gaierror(-2, "Name or service not known"),
         "the host of vllm:8000 could not be resolved (DNS: Name or service not known)"),
        (ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
         "the TLS certificate of vllm:8000 was not accepted"),
        (TimeoutError(), "no answer from vllm:8000 in time"),
    ],
    ids=["refused", "dns", "tls-certificate", "timeout"],
)  # fmt: skip
def test_transport_failures_read_apart(failure: BaseException, words: str) -> None:
    """Was: DNS and TLS failures of `check` both read "connection refused"."""
    assert transport_failure(failure, "vllm:8000").startswith(words)


def test_a_certificate_failure_says_why_it_was_refused() -> None:
    failure = ssl.SSLCertVerificationError(1, "certificate verify failed")
    failure.verify_message = "self-signed certificate"
    assert transport_failure(failure, "vllm:8443") == (
        "the TLS certificate of vllm:8443 was not accepted (self-signed certificate)"
    )
