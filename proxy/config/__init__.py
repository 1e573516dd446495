"""Settings: what the proxy is told, built once at start-up and passed in, never reached for.

Owns: the frozen, validated `Settings` (settings.py). Owns no behaviour of the proxy's own.
May import: nothing of the proxy.
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
    load_settings,
)

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
    "load_settings",
]
