"""`engines:` (several engines sharing GPUs) next to the single-engine `upstream:`."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.config import EngineSettings, Settings, load_settings

TWO = [
    {"name": "policy", "upstream": "http://127.0.0.1:8000/", "gpus": [0]},
    {"name": "judge", "upstream": "http://127.0.0.1:8001", "gpus": [0], "swap_sleep_level": 2, "models": ["j"]},
]


def test_engines_are_read_with_their_defaults() -> None:
    settings = Settings(engines=TWO)
    policy, judge = settings.engines
    assert policy == EngineSettings(name="policy", upstream="http://127.0.0.1:8000")
    assert (policy.gpus, policy.swap_sleep_level, policy.pinned, policy.footprint_gib) == ((0,), 1, False, None)
    assert judge.swap_sleep_level == 2 and judge.models == ("j",)


def test_upstream_and_engines_together_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="either upstream .* or engines"):
        Settings(upstream="http://127.0.0.1:8000", engines=TWO)


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ([TWO[0], {**TWO[1], "name": "policy"}], "names must be unique"),
        ([{**TWO[0], "models": ["m"]}, {**TWO[1], "models": ["m"]}], "one engine only"),
        ([{**TWO[0], "upstream": "sim"}], "single-engine only"),
        ([{**TWO[0], "gpus": []}], "gpus"),
        ([{**TWO[0], "gpus": [0, 0]}], "distinct"),
        ([{**TWO[0], "swap_sleep_level": 0}], "swap_sleep_level"),
        ([{**TWO[0], "name": "a/b"}], "name"),
        ([{**TWO[0], "footprint_gib": 0}], "footprint_gib"),
        ([{**TWO[0], "colour": "red"}], "colour"),
    ],
)
def test_a_bad_engine_is_refused_naming_it(engines: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(engines=engines)


def test_each_engine_is_guarded_with_the_shared_settings_and_its_own_upstream() -> None:
    settings = Settings(
        engines=[TWO[0], {**TWO[1], "on_sleeping": "hold"}], state_file="/run/lg.json", hold_timeout_s=7
    )
    judge = settings.for_engine(settings.engines[1])
    assert judge.upstream == "http://127.0.0.1:8001" and judge.engines == ()
    assert judge.hold_timeout_s == 7 and judge.on_sleeping == "hold"
    assert settings.for_engine(settings.engines[0]).on_sleeping == "wake"  # an engine's default: swap it in
    assert judge.state_file == "/run/lg.json.judge"  # never one file for two engines


def test_engines_from_a_yaml_file(tmp_path: Path) -> None:
    config = tmp_path / "lifeguard.yaml"
    config.write_text(
        "engines:\n"
        "  - {name: policy, upstream: 'http://127.0.0.1:8000', gpus: [0], pinned: true}\n"
        "  - {name: judge, upstream: 'http://127.0.0.1:8001', gpus: [0], footprint_gib: 20}\n"
    )
    settings = load_settings(config)
    assert [e.name for e in settings.engines] == ["policy", "judge"]
    assert settings.engines[0].pinned and settings.engines[1].footprint_gib == 20


def test_engines_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIFEGUARD_ENGINES", '[{"name": "a", "upstream": "http://127.0.0.1:8000", "gpus": [1]}]')
    settings = load_settings()
    assert settings.engines == (EngineSettings(name="a", upstream="http://127.0.0.1:8000", gpus=(1,)),)
