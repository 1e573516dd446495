"""proxy/config/sources.py and startup_errors.py: where a setting was set, as the sentence names it, and the rule for
`LIFEGUARD_*` variables that are no setting (refused, but for the ones this repository's own tools read)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from proxy.config import Settings, SettingsError, load_settings
from proxy.config.sources import TOOL_PREFIXES, TOOL_VARIABLES, _unknown
from proxy.config.urls import url_shown

ROOT = Path(__file__).resolve().parents[3]
#: Where a tool of the repository reads a variable: a shell expansion, an assignment at the start of a line of a
#: script, env file or Dockerfile, or Python's os.environ / getenv.
SHELL_READS = re.compile(r"(?:\$\{?|^\s*(?:export\s+|ENV\s+)?)(LIFEGUARD_[A-Z0-9_]+)(?=[}\"'=:\s-]|$)", re.M)
PYTHON_READS = re.compile(r"(?:environ\.get\(\s*|environ\[\s*|getenv\(\s*)[\"'](LIFEGUARD_[A-Z0-9_]+)")


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in names.split() if not name.endswith((".png", ".svg", ".gz", ".json"))]


def variables_the_repository_reads() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        pattern = PYTHON_READS if path.suffix == ".py" else SHELL_READS
        for match in pattern.finditer(text):
            found.setdefault(match[1], str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_repositorys_tools_read_starts_a_proxy() -> None:
    """A proxy started by a script or a test in that tool's environment must not be refused for its variables."""
    read = variables_the_repository_reads()
    assert len(read) > 20, "the scan finds nothing: its patterns are out of date"
    refused = {name: where for name, where in read.items() if _unknown(name)}
    assert refused == {}, f"add these to proxy/config/sources.py TOOL_VARIABLES (or rename them): {refused}"


def test_every_exception_of_the_rule_is_still_read_somewhere() -> None:
    text = "\n".join(path.read_text(errors="replace") for path in tracked_files() if path.suffix != ".py" or
                     "config/sources.py" not in str(path))  # fmt: skip
    stale = sorted(name for name in TOOL_VARIABLES if name not in text)
    assert stale == [], f"no longer read by anything: remove them from TOOL_VARIABLES: {stale}"
    assert all(prefix in text for prefix in TOOL_PREFIXES)


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("LIFEGUARD_PORT", False),
        ("lifeguard_port", False),  # pydantic-settings reads variables whatever their case
        ("LIFEGUARD_CONFIG", False),
        ("LIFEGUARD_VLLM_MODEL", False),
        ("LIFEGUARD_SERVICE_HOST", False),  # a Service named lifeguard, with service links on
        ("LIFEGUARD_SERVICE_PORT_HTTP", False),
        ("LIFEGUARD_PORT_8080_TCP_ADDR", False),
        ("LIFEGUARD_HOLD_TIMEOUT", True),
        ("lifeguard_hold_timeout", True),
        ("LIFEGUARD_PORTS", True),
        ("OTHER_HOLD_TIMEOUT", False),
    ],
)
def test_which_variables_are_refused(name: str, refused: bool) -> None:
    assert _unknown(name) is refused


def test_every_problem_is_said_at_once_each_with_where_it_was_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "lifeguard.yaml"
    config.write_text("engines:\n  - name: a\n    upstream: http://127.0.0.1:1\n    gpus: [0, 0]\nshutdown_grace: 3\n")
    monkeypatch.setenv("LIFEGUARD_HOLD_TIMOUT_S", "5")
    monkeypatch.setenv("LIFEGUARD_VERIFY_TIMEOUT_S", "soon")
    with pytest.raises(SettingsError) as caught:
        load_settings(config, port=70000)
    assert caught.value.status == 2
    assert caught.value.lines == (
        "invalid settings (5 problems):",
        "  - LIFEGUARD_HOLD_TIMOUT_S is not a setting: rename or unset it (did you mean LIFEGUARD_HOLD_TIMEOUT_S?)",
        f"  - {config}:4: engines[0].gpus must be distinct device indices >= 0 (got [0, 0])",
        "  - --port must be less than or equal to 65535",
        "  - LIFEGUARD_VERIFY_TIMEOUT_S must be a valid number, unable to parse string as a number: change or unset it",
        f"  - {config}:5: shutdown_grace is not a setting: remove or rename it (did you mean shutdown_grace_s?)",
    )


def test_the_strongest_source_is_the_one_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "lifeguard.yaml"
    config.write_text("port: 1\nupstream: http://127.0.0.1:9\n")
    monkeypatch.setenv("LIFEGUARD_PORT", "-1")  # the variable beats the file: the variable is what to change
    with pytest.raises(SettingsError, match="LIFEGUARD_PORT must be greater than or equal to 0: change or unset it"):
        load_settings(config)


def test_an_empty_file_is_every_default(tmp_path: Path) -> None:
    config = tmp_path / "empty.yaml"
    config.write_text("# nothing set\n")
    assert load_settings(config) == Settings()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        ("http://user:pw@vllm:8000/v1", "http://user:***@vllm:8000/v1"),
        ("user:pw@vllm:8000", "user:***@vllm:8000"),  # no scheme: still a password
        ("ftp://u:p@ss@vllm", "ftp://u:***@vllm"),
        ("http://user@vllm:8000", "http://user@vllm:8000"),
    ],
)
def test_a_password_in_a_url_is_never_shown(url: str, shown: str) -> None:
    assert url_shown(url) == shown


def test_a_key_of_a_mapping_setting_is_named_as_a_key(tmp_path: Path) -> None:
    config = tmp_path / "lifeguard.yaml"
    config.write_text("upstream: http://127.0.0.1:9\nroutes:\n  inference: [/a]\n  bogus: [/x]\n")
    with pytest.raises(SettingsError, match=f"{config}:4: routes key 'bogus' must be 'inference', 'at_once'"):
        load_settings(config)
