"""Small response helpers shared by the route modules."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def dumps(obj: Any) -> str:
    # vLLM (pydantic/FastAPI) answers compact JSON.
    return json.dumps(obj, separators=(",", ":"))


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=dumps)
