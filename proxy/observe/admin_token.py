"""The admin token a command-line client sends (`vllm-lifeguard status`, `vllm-lifeguard check`): one rule for
both commands, so that neither borrows it from the other. The proxy's own rule for it is proxy/front/admin.py."""

from __future__ import annotations

import os
from pathlib import Path


def client_admin_token(token: str | None, token_file: str | None) -> str | None:
    """The admin token a command-line client (`status`, `check`) sends: the one in `token_file` (--token-file),
    else `token` (--token), else $LIFEGUARD_ADMIN_TOKEN; None without one. OSError: the file cannot be read."""
    if token_file:
        return Path(token_file).read_text().strip()
    return token or os.environ.get("LIFEGUARD_ADMIN_TOKEN") or None
