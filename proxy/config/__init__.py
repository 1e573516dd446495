"""Settings: what the proxy is told, built once at start-up and passed in, never reached for.

Owns: the frozen, validated `Settings` (settings.py), building them from the flags, the `LIFEGUARD_*` variables and
the YAML file with where each value came from (sources.py), and the one wording of start-up errors
(startup_errors.py). Owns no behaviour of the proxy's own.
May import: compiled (the name of the variable that forces pure Python), nothing else of the proxy.
Door: the package itself, sources (building the settings), startup_errors, urls.
"""

from .settings import (
    DEFAULT_ENGINE,
    SIMULATOR,
    WEIGHT_PUSH_OPERATIONS,
    EngineSettings,
    LogFormat,
    LogLevel,
    OnSleeping,
    RouteClass,
    Settings,
)
from .sources import load_settings
from .startup_errors import SettingsError, StartupError

__all__ = [
    "DEFAULT_ENGINE",
    "SIMULATOR",
    "WEIGHT_PUSH_OPERATIONS",
    "EngineSettings",
    "LogFormat",
    "LogLevel",
    "OnSleeping",
    "RouteClass",
    "Settings",
    "SettingsError",
    "StartupError",
    "load_settings",
]
