"""docs/reference/ is what scripts/docs/reference.py writes from the code now (`make docs`), and the code gives it
everything it needs: a description for every setting, a meaning and advice for every error reason, a line for
every `X-Lifeguard-*` header the proxy spells out."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.docs import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_what_the_code_says() -> None:
    stale = reference.stale()
    assert not stale, f"docs/reference/ is stale ({', '.join(stale)}): run make docs and commit the result"


def test_every_setting_has_a_description() -> None:
    from proxy.config import EngineSettings, Settings

    for model in (Settings, EngineSettings):
        bare = [name for name, field in model.model_fields.items() if not field.description]
        assert not bare, f"{model.__name__} fields without Field(description=...): {bare}"


def test_config_lifeguard_yaml_comments_each_setting_with_its_description() -> None:
    """One wording: the file's comment above each key is the field's description (examples in it aside)."""
    from proxy.config import Settings

    comments = reference.facts.config_comments()
    differ = {
        name: (comments.get(name), " ".join((field.description or "").split()))
        for name, field in Settings.model_fields.items()
        if comments.get(name) != " ".join((field.description or "").split())
    }
    assert not differ, "config/lifeguard.yaml comment != Field(description=...) (file, code):\n" + "\n".join(
        f"{name}:\n  {pair[0]}\n  {pair[1]}" for name, pair in differ.items()
    )


def test_every_reason_says_what_it_means_and_what_to_do() -> None:
    from proxy.errors import LifeguardError

    missing: list[str] = []

    def walk(cls: type[LifeguardError], seen: set[str]) -> None:
        if cls.reason not in seen:
            seen.add(cls.reason)
            if not cls.__doc__ or "advice" not in vars(cls):
                missing.append(cls.reason)
        for sub in cls.__subclasses__():
            walk(sub, seen)

    walk(LifeguardError, set())
    assert not missing, f"error classes without a docstring or an `advice` of their own: {missing}"


def test_the_header_catalogue_names_every_header_the_proxy_spells_out() -> None:
    from proxy.front.wire import LIFEGUARD_HEADERS

    assert set(LIFEGUARD_HEADERS) == set(reference.facts.headers())


def test_the_config_file_points_editors_at_the_schema() -> None:
    first = (ROOT / "config" / "lifeguard.yaml").read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=../docs/reference/config.schema.json"
    schema = json.loads((ROOT / "docs" / "reference" / "config.schema.json").read_text())
    assert schema["additionalProperties"] is False
