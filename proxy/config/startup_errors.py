"""Start-up errors as sentences a person acts on: what is wrong, where it was set (the flag, the `LIFEGUARD_*`
variable, or the YAML file and line), and what to do. The one place that words them: settings and the config file
(exit 2), the listening address and the state file's directory (exit 1). Nothing here prints an input value:
pydantic's errors are read without theirs, so no secret can reach the terminal or a pod's log.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

#: Where every setting is listed with its variable and its flag.
SETTINGS_DOC = "docs/reference/settings.md"


class StartupError(Exception):
    """The proxy cannot start; `lines` say why and what to do, `status` is the exit status (1: the machine or the
    network is not as the settings need it)."""

    status = 1

    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class SettingsError(StartupError):
    """The settings themselves are wrong: a usage error, exit status 2."""

    status = 2

    @classmethod
    def of(cls, problems: Sequence[str]) -> SettingsError:
        if len(problems) == 1:
            return cls(f"invalid settings: {problems[0]}")
        return cls(f"invalid settings ({len(problems)} problems):", *(f"  - {problem}" for problem in problems))


@dataclass(frozen=True)
class Where:
    """Where a value was set, as the person who set it names it."""

    kind: Literal["flag", "variable", "file"]
    name: str  # --port, LIFEGUARD_PORT, or /etc/lifeguard.yaml:12


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` was most likely meant to be (a typo, a missing `_s`), if one is close."""
    found = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.75)
    return next((k for k in known if found and k.lower() == found[0]), None)


def did_you_mean(name: str, known: Iterable[str], spell: Callable[[str], str] = str) -> str:
    match = closest(name, known)
    return f" (did you mean {spell(match)}?)" if match is not None else ""


def unknown_variable(name: str, settings: Iterable[str], prefix: str) -> str:
    hint = did_you_mean(name[len(prefix) :], settings, lambda field: prefix + field.upper())
    return f"{name} is not a setting: rename or unset it{hint or f' (every {prefix}* variable: {SETTINGS_DOC})'}"


def validation_problems(
    exc: ValidationError,
    where: Callable[[tuple[int | str, ...]], Where | None],
    fields: Sequence[str],
    engine_fields: Sequence[str],
) -> list[str]:
    """Each of pydantic's errors as a sentence naming where the value was set; read without the input values."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False, include_context=False):
        loc = tuple(error["loc"])
        if not loc:  # a rule between settings (`upstream:` and `engines:` both set): where each was set
            text = error["msg"].removeprefix("Value error, ")
            named = [(field, where((field,))) for field in fields if re.search(rf"\b{field}\b", text)]
            given = [f"{field} from {place.name}" for field, place in named if place is not None]
            problems.append(text + (f" ({'; '.join(given)})" if given else ""))
            continue
        text, fix, hint = _what(error["type"], error["msg"], loc, fields, engine_fields)
        place, path = where(loc), _path(loc)
        if place is None:
            problems.append(f"{path} {text}{hint}")
        elif place.kind == "variable" and len(loc) > 1:  # a key inside a JSON variable (LIFEGUARD_ENGINES)
            problems.append(f"{place.name}: {path} {text}{': change or unset it' if fix else ''}{hint}")
        elif place.kind == "file":
            problems.append(f"{place.name}: {path} {text}{_then(fix, place)}{hint}")
        else:
            problems.append(f"{place.name} {text}{_then(fix, place)}{hint}")
    return problems


def _then(fix: dict[str, str], place: Where) -> str:
    return f": {fix[place.kind]}" if place.kind in fix else ""


def _what(
    kind: str, msg: str, loc: tuple[int | str, ...], fields: Sequence[str], engine_fields: Sequence[str]
) -> tuple[str, dict[str, str], str]:
    """pydantic's message as the rest of a sentence whose subject is the setting (`must be greater than 0`), what to
    do where it was set, and the name it was likely meant to be."""
    if kind == "extra_forbidden":
        key, fix = str(loc[-1]), {"variable": "rename or unset it", "file": "remove or rename it"}
        if len(loc) == 1:
            return "is not a setting", fix, did_you_mean(key, fields)
        if loc[0] == "engines":
            return "is not a key of an engine", fix, did_you_mean(key, engine_fields)
        return "is not allowed here", fix, ""
    if kind == "value_error":  # the proxy's own validators: their message says what to do too
        return msg.removeprefix("Value error, "), {}, ""
    text = re.sub(r"^(Input|String|Tuple|List|Dictionary|Value) should ", "must ", msg)
    return text, {"variable": "change or unset it", "file": "change it there"}, ""


def _path(loc: tuple[int | str, ...]) -> str:
    """`('engines', 0, 'upstream')` as `engines[0].upstream`; a mapping's key (`('routes', 'x', '[key]')`) as
    `routes key 'x'`."""
    if len(loc) > 1 and loc[-1] == "[key]":
        return f"{_path(loc[:-2])} key {str(loc[-2])!r}"
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def json_problem(variable: str, exc: BaseException) -> str:
    """A variable of a JSON setting (`LIFEGUARD_ENGINES`, `LIFEGUARD_ROUTES`) that does not parse."""
    cause = exc.__cause__
    at = (
        f" ({cause.msg} at line {cause.lineno}, column {cause.colno})"
        if isinstance(cause, json.JSONDecodeError)
        else ""
    )
    return f"{variable} is not valid JSON{at}: change or unset it (its shape: {SETTINGS_DOC})"


def yaml_problem(path: Path, exc: Any) -> str:
    """A config file that is not YAML, at the line and column the parser stopped: its own words, never the line's
    text (it may hold a token)."""
    mark = getattr(exc, "problem_mark", None)
    at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    said = ", ".join(str(part) for part in (getattr(exc, "problem", None), getattr(exc, "context", None)) if part)
    return f"{path}{at}: not valid YAML ({said or 'the parser stopped here'}): fix it there"


def config_file_problem(path: Path, named_by: str, exc: OSError) -> str:
    reason = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({_strerror(exc)})"
    return (
        f"the config file {path} ({named_by}) {reason}: give the path of a YAML settings file as config/lifeguard.yaml"
    )


def not_a_mapping(path: Path, value: object) -> str:
    kind = {str: "a single string", list: "a list", int: "a number", float: "a number", bool: "a boolean"}
    return (
        f"{path}: the file must be a mapping of settings, one `name: value` a line (as config/lifeguard.yaml), not "
        f"{kind.get(type(value), type(value).__name__)}"
    )


NO_UPSTREAM = (
    "no upstream to guard: set --upstream http://HOST:PORT (env LIFEGUARD_UPSTREAM, or upstream: in --config), "
    "--upstream sim for the embedded simulator, or engines: in --config"
)


def cannot_listen(host: str, port: int, exc: OSError, *, port_flag: str = "--port") -> StartupError:
    """The listening socket could not be bound: which address, why in words, what to do."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if exc.errno == errno.EADDRINUSE:
        why = (
            f"another process is listening on port {port} (`ss -ltnp 'sport = :{port}'` shows which): stop it, "
            f"or pick another port with {port_flag}"
        )
    elif exc.errno == errno.EACCES:
        why = (
            f"permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE): pick a port of 1024 or more "
            f"with {port_flag}"
        )
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"no interface of this machine has the address {host}: listen on 127.0.0.1 (this machine) or 0.0.0.0"
    elif isinstance(exc, socket.gaierror):
        why = f"the host name {host!r} does not resolve ({_strerror(exc)}): give an address, e.g. 127.0.0.1"
    else:
        why = _strerror(exc)
    return StartupError(f"cannot listen on {where}: {why}")


def state_file_problem(path: str) -> StartupError | None:
    """The state file cannot be written where `state_file` puts it: said once at start, not at every change."""
    directory = Path(path).parent
    if not directory.is_dir():
        missing = "does not exist" if not directory.exists() else "is not a directory"
    elif not os.access(directory, os.W_OK | os.X_OK):
        missing = "is not writable by this user"
    else:
        return None
    return StartupError(
        f"cannot keep the state file {path}: its directory {directory} {missing}; create it (on a volume that "
        "outlives the container, e.g. an emptyDir) or point state_file (LIFEGUARD_STATE_FILE) elsewhere"
    )


def _strerror(exc: OSError) -> str:
    text = exc.strerror or type(exc).__name__
    return text[:1].lower() + text[1:]
