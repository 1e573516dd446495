"""Log lines: readable key=value by default, one JSON object per line on request, never a secret."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from proxy.observe.logs import configure_logging

LIFECYCLE_EXTRA = {
    "event": "lifecycle_op",
    "operation": "wake_up",
    "from_state": "SLEEPING",
    "to_state": "RUNNING",
    "duration_s": 2.0134567,
    "outcome": "ok",
    "verification": {"flags": "pass", "memory": "pass"},
    "upstream_status": 200,
    "request_id": "req-42",
}


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    buffer = io.StringIO()
    yield buffer
    for handler in list(root.handlers):
        if handler not in saved_handlers:
            root.removeHandler(handler)
    root.setLevel(saved_level)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_line_has_timestamp_level_logger_message_and_the_extras(stream: io.StringIO):
    configure_logging("info", "json", stream=stream)
    logging.getLogger("lifeguard.coordinator").info("wake_up verified", extra=LIFECYCLE_EXTRA)
    [line] = lines(stream)
    record = json.loads(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["timestamp"])
    assert record["level"] == "INFO"
    assert record["logger"] == "lifeguard.coordinator"
    assert record["message"] == "wake_up verified"
    for key, expected in LIFECYCLE_EXTRA.items():
        assert record[key] == expected


def test_text_line_is_readable_with_key_value_extras(stream: io.StringIO):
    configure_logging("info", "text", stream=stream)
    logging.getLogger("lifeguard.gate").warning(
        "held request ended",
        extra={
            "event": "hold_ended",
            "outcome": "hold_timeout",
            "reason": "slept 5 min",
            "gone": None,
        },
    )
    [line] = lines(stream)
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING lifeguard.gate held request ended ", line)
    assert " event=hold_ended outcome=hold_timeout " in line
    assert 'reason="slept 5 min"' in line  # values with spaces are quoted
    assert line.endswith("gone=null")


def test_text_renders_floats_short_and_structures_as_compact_json(stream: io.StringIO):
    configure_logging("info", "text", stream=stream)
    logging.getLogger("lifeguard.coordinator").info("op", extra=LIFECYCLE_EXTRA)
    [line] = lines(stream)
    assert " duration_s=2.01346 " in line
    assert ' verification="{\\"flags\\":\\"pass\\",\\"memory\\":\\"pass\\"}" ' in line
    assert " upstream_status=200 request_id=req-42" in line


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_secret_keys_are_never_written(stream: io.StringIO, fmt):
    configure_logging("debug", fmt, stream=stream)  # type: ignore[arg-type]
    logging.getLogger("lifeguard.handlers").info(
        "call",
        extra={
            "admin_token": "s3cr3t-A",
            "Authorization": "Bearer s3cr3t-B",
            "client_secret": "s3cr3t-C",
            "headers": {"authorization": "Bearer s3cr3t-D", "x-session-id": "abc"},
            "operation": "sleep",
        },
    )
    out = stream.getvalue()
    assert "s3cr3t" not in out
    assert "operation" in out and "abc" in out


def test_level_filters_lower_records(stream: io.StringIO):
    configure_logging("warning", "text", stream=stream)
    log = logging.getLogger("lifeguard.test")
    log.info("quiet")
    log.warning("loud")
    assert [line.split(" ", 3)[3] for line in lines(stream)] == ["loud"]


def test_configuring_twice_replaces_the_handler_instead_of_doubling_lines(stream: io.StringIO):
    configure_logging("info", "text", stream=io.StringIO())
    configure_logging("info", "json", stream=stream)
    logging.getLogger("lifeguard.test").info("once")
    assert len(lines(stream)) == 1
    assert json.loads(lines(stream)[0])["message"] == "once"


def test_json_stays_valid_for_nan_exceptions_and_unserialisable_values(stream: io.StringIO):
    configure_logging("info", "json", stream=stream)
    log = logging.getLogger("lifeguard.test")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed", extra={"drift": float("nan"), "obj": object(), "level": "clash"})
    [line] = lines(stream)  # the traceback is inside the one JSON line
    record = json.loads(line)
    assert record["drift"] == "nan"
    assert record["obj"].startswith("<object object")
    assert record["level"] == "ERROR" and record["extra_level"] == "clash"
    assert "RuntimeError: boom" in record["exception"]


def test_unknown_level_or_format_is_refused():
    with pytest.raises(ValueError):
        configure_logging("loud", "text")
    with pytest.raises(ValueError):
        configure_logging("info", "xml")  # type: ignore[arg-type]
