"""Which engine serves a model name (proxy/front/model_directory.py), against stand-in engines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.config import EngineSettings, Settings
from proxy.errors import UpstreamUnreachable
from proxy.front import model_directory
from proxy.front.model_directory import ModelDirectory
from proxy.upstream.vllm_client import Reply


class StandIn:
    """An engine's `/v1/models`, counted; `down` makes it unreachable."""

    def __init__(self, *models: str) -> None:
        self.models = list(models)
        self.asked = 0
        self.down = False

    async def call(self, method: str, path: str, **_: Any) -> Reply:
        assert (method, path) == ("GET", "/v1/models")
        self.asked += 1
        if self.down:
            raise UpstreamUnreachable("down")
        body = {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "vllm"} for m in self.models]}
        return Reply(200, json.dumps(body).encode(), "application/json")


class Guarded:
    """What the directory reads of an engine (proxy/lifecycle/engine.py): its settings, configuration and client."""

    def __init__(self, settings: Settings, config: EngineSettings, client: StandIn) -> None:
        self.settings, self.config, self.client = settings, config, client


def _directory(**configured: list[str]) -> tuple[ModelDirectory, dict[str, StandIn]]:
    clients = {"a": StandIn("model-a"), "b": StandIn("model-b", "lora-b")}
    settings = Settings(
        engines=[
            {"name": name, "upstream": f"http://127.0.0.1:{8000 + i}", "models": configured.get(name, [])}
            for i, name in enumerate(clients)
        ]
    )
    engines = {config.name: Guarded(settings, config, clients[config.name]) for config in settings.engines}
    return ModelDirectory(engines), clients  # type: ignore[arg-type]


async def test_names_are_discovered_from_each_engine_and_asked_once() -> None:
    directory, engines = _directory()
    assert await directory.engine_for("lora-b") == "b"
    assert await directory.engine_for("model-a") == "a"
    assert (engines["a"].asked, engines["b"].asked) == (1, 1)
    assert directory.names() == {"a": ["model-a"], "b": ["lora-b", "model-b"]}


async def test_an_unknown_name_asks_again_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(model_directory.time, "monotonic", lambda: now[0])
    directory, engines = _directory()
    assert await directory.engine_for("nope") is None
    assert await directory.engine_for("nope-again") is None
    assert engines["a"].asked == 1  # a flood of unknown names is not a flood of /v1/models calls
    now[0] += 1.5
    assert await directory.engine_for("nope") is None
    assert engines["a"].asked == 2


async def test_configured_names_route_even_when_the_engine_is_down() -> None:
    directory, engines = _directory(b=["judge"])
    engines["b"].down = True
    assert await directory.engine_for("judge") == "b"
    assert engines["b"].asked == 0
    listing = await directory.listing()
    assert [card["id"] for card in listing["data"]] == ["model-a", "judge"]  # b's configured name stands in
    assert await directory.engine_for("model-b") is None  # configured names are the routing for b
