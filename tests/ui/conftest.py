"""The status page in headless Chromium (`make test-ui`, marker `ui`): the same stacks as tests/e2e."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.conftest import make_engines, make_stack

__all__ = ["make_engines", "make_stack"]  # fixtures, shared with tests/e2e

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.ui)


@pytest.fixture
def artifacts() -> Path:
    """Where screenshots and the browser's log are kept (CI keeps the folder): $LIFEGUARD_UI_ARTIFACTS or build/ui."""
    folder = Path(os.environ.get("LIFEGUARD_UI_ARTIFACTS") or HERE.parents[1] / "build" / "ui")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
