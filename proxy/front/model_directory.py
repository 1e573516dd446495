"""`ModelDirectory`: which engine serves a model name, when several engines share one port.

Names come from `engines[].models` when configured, else from each engine's own `GET /v1/models` (asked at
the first request for a name not known yet, and again, at most once a second, when a name is still unknown:
a LoRA adapter loaded later shows up there too). A sleeping vLLM still answers `/v1/models`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from ..errors import UpstreamError
from ..lifecycle.engine import Engine

log = logging.getLogger("lifeguard.models")

_REFRESH_AT_MOST_EVERY_S = 1.0


class ModelDirectory:
    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self._engines = engines
        self._configured = {model: name for name, engine in engines.items() for model in engine.config.models}
        self._discovered: dict[str, str] = {}
        self._cards: dict[str, list[dict[str, Any]]] = {}
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Lock = asyncio.Lock()

    def known(self, model: str) -> str | None:
        return self._configured.get(model) or self._discovered.get(model)

    async def engine_for(self, model: str) -> str | None:
        """The engine serving `model`, or None when no engine does (after asking the engines once more)."""
        found = self.known(model)
        if found is None:
            await self.refresh()
            found = self.known(model)
        return found

    async def refresh(self) -> None:
        async with self._refreshing:
            if time.monotonic() - self._refreshed_at < _REFRESH_AT_MOST_EVERY_S:
                return
            await asyncio.gather(*(self._ask(name) for name in self._engines))
            self._refreshed_at = time.monotonic()

    async def listing(self) -> dict[str, Any]:
        """`GET /v1/models` over every engine: each engine's own cards, or cards for its configured names when
        it cannot be asked."""
        await asyncio.gather(*(self._ask(name) for name in self._engines))
        data: list[dict[str, Any]] = []
        for name, engine in self._engines.items():
            cards = self._cards.get(name)
            if cards is None:
                cards = [
                    {"id": model, "object": "model", "owned_by": "vllm", "root": model}
                    for model in engine.config.models
                ]
            data.extend(cards)
        return {"object": "list", "data": data}

    def names(self) -> dict[str, list[str]]:
        """Per engine, the model names routed to it (for /lifeguard/state)."""
        names: dict[str, list[str]] = {name: [] for name in self._engines}
        for model, engine in {**self._discovered, **self._configured}.items():
            names[engine].append(model)
        return {engine: sorted(models) for engine, models in names.items()}

    async def _ask(self, name: str) -> None:
        engine = self._engines[name]
        key = engine.settings.upstream_api_key
        auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else None
        try:
            reply = await engine.client.call("GET", "/v1/models", headers=auth)
            cards = reply.json()["data"] if reply.status == 200 else None
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            log.debug("cannot list the models of %s: %r", name, exc)
            return
        if not isinstance(cards, list):
            return
        cards = [card for card in cards if isinstance(card, dict) and isinstance(card.get("id"), str)]
        self._cards[name] = cards
        if engine.config.models:
            return  # configured names are the routing; the engine's cards are only listed
        for card in cards:
            owner = self._discovered.setdefault(card["id"], name)
            if owner != name:
                log.warning("model %s is served by %s and %s; requests go to %s", card["id"], owner, name, owner)
