"""Which vLLM release an engine is, from its `/version` answer: behaviour that changed between releases (a level-1
sleep's backup kept after the wake, `reset_connector`: both from 0.34) is decided here, once."""

from __future__ import annotations


def at_least(version: object, release: tuple[int, int]) -> bool:
    """Whether `version` ("0.34.0", "0.35.1rc1") is `release` (major, minor) or later; False where it is no version."""
    if not isinstance(version, str):
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= release
