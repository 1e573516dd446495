"""config/lifeguard.yaml documents every setting with the code's default, and the loader accepts it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

import proxy.config
from proxy.config import Settings, SettingsError, load_settings
from tests.lifeguard_testing import without_lifeguard_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "lifeguard.yaml"


@pytest.fixture(autouse=True)
def _no_lifeguard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's LIFEGUARD_* variables would otherwise win over the file and mask a mismatch."""
    without_lifeguard_env(monkeypatch)


def _documented() -> dict[str, Any]:
    data = yaml.safe_load(CONFIG.read_text())
    assert isinstance(data, dict), "config/lifeguard.yaml must be a mapping"
    return data


def _plain(value: Any) -> Any:
    """Compare YAML (lists) with code defaults (tuples, SecretStr) on equal terms."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def test_the_file_names_exactly_the_settings_fields_in_code_order() -> None:
    documented = list(_documented())
    fields = list(Settings.model_fields)
    missing = sorted(set(fields) - set(documented))
    unknown = sorted(set(documented) - set(fields))
    assert not missing, f"settings missing from config/lifeguard.yaml: {missing}"
    assert not unknown, f"keys in config/lifeguard.yaml that Settings does not have: {unknown}"
    assert documented == fields, "keep config/lifeguard.yaml in the order of proxy/config/settings.py"


def test_every_documented_value_equals_the_code_default() -> None:
    documented = _documented()
    wrong = {}
    for name, field in Settings.model_fields.items():
        code_default = _plain(field.get_default(call_default_factory=True))
        if _plain(documented.get(name)) != code_default:
            wrong[name] = {"yaml": documented.get(name), "code": code_default}
    assert not wrong, f"documented defaults differ from proxy/config/settings.py: {wrong}"


def test_the_groups_follow_the_code() -> None:
    """The `# --- group` headings are the same, in the same order, as in proxy/config/settings.py."""
    heading = re.compile(r"^\s*# ---\s*(.+?)\s*$", re.MULTILINE)
    in_code = heading.findall(inspect.getsource(proxy.config.Settings))
    in_yaml = heading.findall(CONFIG.read_text())
    assert in_yaml == in_code


def test_every_setting_has_a_one_line_comment_right_above_it() -> None:
    lines = CONFIG.read_text().splitlines()
    top_level = re.compile(r"^([a-z_][a-z0-9_]*):")
    uncommented = []
    for index, line in enumerate(lines):
        match = top_level.match(line)
        if match and (index == 0 or not lines[index - 1].startswith("# ") or "---" in lines[index - 1]):
            uncommented.append(match.group(1))
    assert not uncommented, f"settings without a comment line above them: {uncommented}"


def test_load_settings_accepts_the_file_and_yields_the_code_defaults() -> None:
    from_file = load_settings(config_file=CONFIG)
    assert from_file == Settings()


def test_a_value_in_the_file_reaches_the_settings(tmp_path: Path) -> None:
    custom = tmp_path / "lifeguard.yaml"
    custom.write_text(
        CONFIG.read_text()
        .replace("port: 8080", "port: 9090")
        .replace("upstream: null", "upstream: http://127.0.0.1:8000/")
    )
    settings = load_settings(config_file=custom)
    assert settings.port == 9090
    assert settings.upstream == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("replace", "by", "field"),
    [
        ("port: 8080", "port: eighty", "port"),
        ("port: 8080", "port: 70000", "port"),
        ("on_sleeping: hold", "on_sleeping: snooze", "on_sleeping"),
        ("gpu_probe: nvml", "gpu_probe: cuda", "gpu_probe"),
        ("upstream: null", "upstream: 127.0.0.1:8000", "upstream"),
        ("hold_timeout_s: 300.0", "hold_timeout_s: -1", "hold_timeout_s"),
        ("shutdown_grace_s: 30.0", "shutdown_grace_s: 30.0\nshutdown_grace: 5", "shutdown_grace"),
    ],
)
def test_a_bad_value_in_the_file_fails_naming_the_field_and_its_line(
    tmp_path: Path, replace: str, by: str, field: str
) -> None:
    """Was: pydantic's dump, naming the field but neither the file nor the line."""
    text = CONFIG.read_text()
    assert replace in text, f"fixture out of date: {replace!r} is not in config/lifeguard.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(replace, by))
    line = next(n for n, row in enumerate(bad.read_text().splitlines(), 1) if row.startswith(f"{field}:"))
    with pytest.raises(SettingsError) as caught:
        load_settings(config_file=bad)
    assert caught.value.status == 2
    assert f"{bad}:{line}: {field} " in str(caught.value)
    assert "input_value" not in str(caught.value) and "errors.pydantic.dev" not in str(caught.value)


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="the config file .*nope.yaml \\(--config\\) does not exist"):
        load_settings(config_file=tmp_path / "nope.yaml")


def test_every_setting_can_also_be_given_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same settings by env var: LIFEGUARD_<NAME>, comma-separated for lists."""
    monkeypatch.setenv("LIFEGUARD_PORT", "9191")
    monkeypatch.setenv("LIFEGUARD_GPU_DEVICES", "0, 1")
    monkeypatch.setenv("LIFEGUARD_WEIGHT_RELOAD_RPC_METHODS", "reload_weights,update_weights_from_path")
    monkeypatch.setenv("LIFEGUARD_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("LIFEGUARD_CANARY_ENABLED", "false")
    settings = load_settings(config_file=CONFIG)  # env beats the file
    assert settings.port == 9191
    assert settings.gpu_devices == ("0", "1")
    assert settings.weight_reload_rpc_methods == ("reload_weights", "update_weights_from_path")
    assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "s3cret"
    assert settings.canary_enabled is False
