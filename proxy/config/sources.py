"""Building `Settings` from where a person sets them, knowing where each value came from: the flags, the
`LIFEGUARD_*` environment variables, the YAML file (`--config` or `LIFEGUARD_CONFIG`), strongest first.

Every problem with them is one `SettingsError` (proxy/config/startup_errors.py words it), all of them at once. A
`LIFEGUARD_` variable that is no setting is refused as an unknown YAML key is, except the few named below
(docs/reference/settings.md, "Environment variables").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import SettingsError as SourceError

from ..compiled import PURE_VARIABLE
from .settings import FILE_VALUES, EngineSettings, Settings
from .startup_errors import (
    SettingsError,
    Where,
    config_file_problem,
    json_problem,
    not_a_mapping,
    unknown_variable,
    validation_problems,
    yaml_problem,
)

PREFIX = "LIFEGUARD_"
CONFIG_VARIABLE = "LIFEGUARD_CONFIG"
#: A setting removed, still accepted as its YAML key is (`data_plane: raw`; Settings._no_data_plane).
REMOVED_VARIABLE = "LIFEGUARD_DATA_PLANE"
#: `LIFEGUARD_` variables that the repository's own scripts, tests and CI read, not settings of `serve`: left alone,
#: so that a proxy started in their environment starts (tests/unit/config/test_settings_sources.py fails on one they
#: read and this lacks).
TOOL_VARIABLES = frozenset(
    {
        "LIFEGUARD_CACHE",
        "LIFEGUARD_CI_RECORD",
        "LIFEGUARD_CLIENTS_HOME",
        "LIFEGUARD_CLIENTS_PYTHON",
        "LIFEGUARD_CLIENTS_PYTHON_HOME",
        "LIFEGUARD_CLIENTS_SITE",
        "LIFEGUARD_FLEET_LOG_DIR",
        "LIFEGUARD_FLEET_REPORT",
        "LIFEGUARD_IMAGE",
        "LIFEGUARD_IMAGE_REPORT",
        "LIFEGUARD_POD_YAML",
        "LIFEGUARD_PODS_LOCK_DIR",
        "LIFEGUARD_PODS_YAML",
        "LIFEGUARD_ROUTER_BIN",
        "LIFEGUARD_TEST_BUILD",
        "LIFEGUARD_TEST_IMAGE",
        "LIFEGUARD_TEST_LOOP",
        "LIFEGUARD_UI_ARTIFACTS",
        "LIFEGUARD_WHEEL_CACHE",
    }
)
#: scripts/vllm/setup-vllm.sh prints `LIFEGUARD_VLLM_*` for the real-vLLM tests to export.
TOOL_PREFIXES = ("LIFEGUARD_VLLM_",)
#: Kubernetes' service links for a Service named `lifeguard` (LIFEGUARD_SERVICE_HOST, LIFEGUARD_SERVICE_PORT,
#: LIFEGUARD_PORT_8080_TCP...), set in every pod of its namespace unless `enableServiceLinks: false`
#: (deploy/k8s/base/deployment.yaml has it).
SERVICE_LINK = re.compile(
    r"^LIFEGUARD_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)$"
)


@dataclass(frozen=True)
class YamlFile:
    """The config file's values, and its node tree for the line each value is on."""

    path: Path
    values: dict[str, Any]
    root: yaml.Node | None  # None: an empty file

    def where(self, loc: tuple[int | str, ...]) -> Where:
        if self.root is None:
            return Where("file", str(self.path))
        node, line = self.root, self.root.start_mark.line
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                found = next(((key, value) for key, value in node.value if key.value == str(part)), None)
                if found is None:
                    break
                line, node = found[0].start_mark.line, found[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line
            else:
                break
        return Where("file", f"{self.path}:{line + 1}")


@dataclass(frozen=True)
class Origins:
    """Where each setting given was set: `flags` (setting: flag as spelled), the variables, the file."""

    flags: dict[str, str]
    variables: dict[str, str]  # setting: the variable's name as spelled in the environment
    file: YamlFile | None = None

    def where(self, loc: tuple[int | str, ...]) -> Where | None:
        name = str(loc[0]) if loc else ""
        if name in self.flags:
            return Where("flag", self.flags[name])
        if name in self.variables:
            return Where("variable", self.variables[name])
        if self.file is not None and name in self.file.values:
            return self.file.where(loc)
        return None


def load_settings(
    config_file: str | Path | None = None,
    *,
    config_named_by: str = "--config",
    flag_names: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build Settings from flags (`overrides`; `flag_names` spells a flag whose name is not `--<setting>`), the
    environment and an optional YAML file; raises `SettingsError` naming every problem and where it was set."""
    flags = {key: value for key, value in overrides.items() if value is not None}
    names = flag_names or {}
    variables = {_setting_of(name): name for name in os.environ if _setting_of(name) in Settings.model_fields}
    problems = [unknown_variable(name, Settings.model_fields, PREFIX) for name in sorted(os.environ) if _unknown(name)]
    file = _read_yaml(Path(config_file), config_named_by) if config_file is not None else None
    origins = Origins({key: names.get(key, "--" + key.replace("_", "-")) for key in flags}, variables, file)
    if REMOVED_VARIABLE in os.environ:  # refused unless `raw`, as in the file (Settings._no_data_plane)
        flags.setdefault("data_plane", os.environ[REMOVED_VARIABLE])
    token = FILE_VALUES.set(file.values if file is not None else None)
    try:
        settings = Settings(**flags)
    except ValidationError as exc:
        fields, engine_fields = tuple(Settings.model_fields), tuple(EngineSettings.model_fields)
        problems += validation_problems(exc, origins.where, fields, engine_fields)
    except SourceError as exc:  # a JSON setting's variable that does not parse
        setting = re.search(r'field "(\w+)"', str(exc))
        problems.append(json_problem(variables.get(setting[1] if setting else "", "a LIFEGUARD_ variable"), exc))
    finally:
        FILE_VALUES.reset(token)
    if problems:
        raise SettingsError.of(problems)
    return settings


def _setting_of(variable: str) -> str:
    """The setting a variable would set (pydantic-settings reads them case-insensitively): `port` for LIFEGUARD_PORT."""
    upper = variable.upper()
    return upper[len(PREFIX) :].lower() if upper.startswith(PREFIX) else ""


def _unknown(variable: str) -> bool:
    upper = variable.upper()
    if not upper.startswith(PREFIX) or _setting_of(variable) in Settings.model_fields:
        return False
    if upper in (CONFIG_VARIABLE, REMOVED_VARIABLE, PURE_VARIABLE) or upper in TOOL_VARIABLES:
        return False
    if upper.startswith(TOOL_PREFIXES):
        return False
    return not SERVICE_LINK.match(upper)


def _read_yaml(path: Path, named_by: str) -> YamlFile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        error = exc if isinstance(exc, OSError) else OSError(0, "not UTF-8 text")
        raise SettingsError.of([config_file_problem(path, named_by, error)]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError.of([yaml_problem(path, exc)]) from None
    if root is None or values is None:  # an empty file: every default
        return YamlFile(path, {}, None)
    if not isinstance(values, dict):
        raise SettingsError.of([not_a_mapping(path, values)])
    return YamlFile(path, values, root)
