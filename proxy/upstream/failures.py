"""What went wrong talking to vLLM, in words: the one reading of a transport failure, for the pool, the control
client and `vllm-lifeguard check`."""

from __future__ import annotations

import socket
import ssl

import aiohttp


def transport_failure(exc: BaseException, address: str) -> str:
    """What went wrong talking to vLLM at `address` (host:port), as a person would say it, never a library's repr:
    `connection refused by 127.0.0.1:8000`. Refused, DNS, TLS and timeouts read apart: each has its own fix."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        address, exc = f"{exc.host}:{exc.port}", exc.os_error
    if isinstance(exc, ssl.SSLError):  # the ssl module's own set `reason` (and `verify_message`); be lenient
        reason = getattr(exc, "reason", None)
        if isinstance(exc, ssl.SSLCertVerificationError):
            why = getattr(exc, "verify_message", None) or reason or exc.strerror
            return f"the TLS certificate of {address} was not accepted ({why})"
        plain = "; it answers plain HTTP: use http://" if reason == "WRONG_VERSION_NUMBER" else ""
        return f"the TLS handshake with {address} failed ({reason or exc.strerror}){plain}"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused by {address}"
    if isinstance(exc, ConnectionResetError):
        return f"connection reset by {address}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{address} closed the connection before answering"
    if isinstance(exc, socket.gaierror):
        return f"the host of {address} could not be resolved (DNS: {exc.strerror})"
    if isinstance(exc, TimeoutError):
        return f"no answer from {address} in time"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror[:1].lower()}{exc.strerror[1:]} ({address})"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"the answer from {address} broke off"
    text = str(exc)
    return f"{text} ({address})" if text else f"{type(exc).__name__} talking to {address}"
