"""Log set-up: one handler on the root logger, readable `key=value` lines or one JSON object a line.

Owns the format of every line, not what is logged: modules log through `logging.getLogger("lifeguard.<area>")`
with the facts in `extra=` (an `event` name first). An extra whose key contains "token", "authorization" or
"secret" is dropped, never written. Examples of both formats: docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "configure_logging", "extras_of"]

_SECRET_MARKERS = ("token", "authorization", "secret")

# Every attribute a plain LogRecord carries; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}

# Keys of the JSON line itself; an extra with one of these names is written as ``extra_<name>``.
_RESERVED = frozenset({"timestamp", "level", "logger", "message", "exception", "stack"})


def _is_secret(key: str) -> bool:
    lowered = key.lower()
    return any(marker in lowered for marker in _SECRET_MARKERS)


def extras_of(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of ``record``, in the order given, secrets removed."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _RECORD_ATTRS and not key.startswith("_") and not _is_secret(key)
    }


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _jsonable(value: Any) -> Any:
    # json.dumps writes NaN/Infinity by default, which is not JSON; log shippers reject the line.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items() if not _is_secret(str(k))}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, logger, message, then the extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extras_of(record).items():
            line[f"extra_{key}" if key in _RESERVED else key] = _jsonable(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def _text_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, ".6g")
    if isinstance(value, (int, str)):
        text = str(value)
    else:
        text = json.dumps(_jsonable(value), default=str, ensure_ascii=False, separators=(",", ":"))
    if text == "" or any(c in text for c in ' ="\n\t') or not text.isprintable():
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """A readable line: ``timestamp LEVEL logger message key=value ...`` (logfmt-style quoting)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts.extend(f"{key}={_text_value(value)}" for key, value in extras_of(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class _LifeguardHandler(logging.StreamHandler):  # type: ignore[type-arg]  # generic only from 3.11
    """Marks the handler we installed, so configuring twice replaces it instead of doubling lines."""


def configure_logging(level: str, fmt: Literal["text", "json"], *, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) at ``level`` (debug|info|...) in ``fmt``.

    Idempotent: a second call replaces the handler the first one installed.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    elif fmt == "text":
        formatter = TextFormatter()
    else:
        raise ValueError(f"unknown log format {fmt!r}; expected 'text' or 'json'")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _LifeguardHandler)]:
        root.removeHandler(old)
        old.close()
    handler = _LifeguardHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(numeric)
