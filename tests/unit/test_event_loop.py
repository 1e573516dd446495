"""`serve` runs on uvloop (less CPU per relayed request, docs/performance.md), on asyncio's own loop when told, and
says so rather than failing where uvloop is not installed."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from proxy.cli import event_loop_factory
from proxy.config import Settings


def test_serve_runs_on_uvloop_by_default_and_on_asyncio_when_told():
    assert Settings().event_loop == "uvloop"
    loop = event_loop_factory("uvloop")()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    loop = event_loop_factory("asyncio")()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.BaseEventLoop)
    finally:
        loop.close()


def test_without_uvloop_installed_serve_says_so_and_runs_on_asyncio(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    with caplog.at_level(logging.WARNING, logger="lifeguard"):
        factory = event_loop_factory("uvloop")
    assert factory is asyncio.new_event_loop
    assert "uvloop is not installed" in caplog.text


def test_an_unknown_event_loop_is_a_settings_error():
    with pytest.raises(ValueError, match="event_loop"):
        Settings(event_loop="trio")  # type: ignore[arg-type]
