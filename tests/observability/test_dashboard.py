"""The checked-in dashboard: provisioning copy in sync, templated by namespace/pod, only our metrics.

Whether each query returns data is proved against a real Prometheus by tests/observability.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.metrics import Metrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
SELECTOR = 'namespace=~"$namespace", pod=~"$pod"'
VLLM_METRICS = {"vllm:engine_sleep_state"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((GRAFANA / "lifeguard-dashboard.json").read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def walk(items: list[dict[str, Any]]) -> None:
        for item in items:
            found.append(item)
            walk(item.get("panels", []))

    walk(dashboard()["panels"])
    return found


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    metrics = Metrics(registry, version="x", engines=["a"], states=["STARTING", "RUNNING"], operations=["sleep"])
    metrics.engine("a").gpu_memory("0", 1, 2)
    metrics.swap_finished("a", "ok", 1.0)
    names = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        names.update(sample.name for sample in family.samples)
    return names


def test_configmap_carries_exactly_the_dashboard_json_with_the_sidecar_label():
    configmap = yaml.safe_load((GRAFANA / "configmap.yaml").read_text())
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"]["lifeguard-dashboard.json"] == (GRAFANA / "lifeguard-dashboard.json").read_text()


def test_dashboard_is_templated_by_datasource_namespace_and_pod():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name in ("namespace", "pod"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["multi"]


def test_every_query_panel_filters_on_namespace_and_pod_and_uses_the_variable_datasource():
    query_panels = [p for p in panels() if p["type"] != "row"]
    assert len(query_panels) >= 15
    for panel in query_panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            selectors = re.findall(r"\{([^}]*)\}", target["expr"])
            metric_selectors = [s for s in selectors if "=" in s]
            assert metric_selectors, (panel["title"], target["expr"])
            for selector in metric_selectors:
                assert selector.startswith(SELECTOR), (panel["title"], selector)


def test_every_metric_a_panel_names_is_one_we_or_vllm_export():
    known = exported_names() | VLLM_METRICS
    for panel in panels():
        for target in panel.get("targets", []):
            for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", target["expr"]):
                assert name in known, (panel["title"], name)


def test_the_issue_s_panels_are_all_there():
    titles = " | ".join(p["title"] for p in panels()).lower()
    for words in (
        "lifeguard state per pod",
        "operation duration (p50 / p99)",
        "held and in-flight",
        "hold time",
        "rejections by reason",
        "lies",
        "drift, engine restarts",
        "gpu memory",
        "vllm engine sleep state",
        "proxy request rate",
        "proxy request latency",
    ):
        assert words in titles, words


def test_the_state_timeline_names_every_state_of_the_machine_in_order() -> None:
    """The timeline maps lifeguard_state to a code per state, in the machine's order; a state added to the
    machine and not to the dashboard would show as another state, not as no data."""
    from proxy.lifecycle.states import State

    panel = next(p for p in panels() if "(lifeguard_state)" in p.get("description", ""))
    options = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    named = [options[code]["text"] for code in sorted(options, key=int)]
    assert named == [s.value for s in State]


def test_the_docs_give_the_timeline_codes_the_dashboard_uses() -> None:
    """Was: docs/observability.md said 10 = FAILED where the dashboard maps FAILED to 11 (SCALING took 10)."""
    panel = next(p for p in panels() if "(lifeguard_state)" in p.get("description", ""))
    codes = {
        option["text"]: code for code, option in panel["fieldConfig"]["defaults"]["mappings"][0]["options"].items()
    }
    said = re.search(
        r"\(1 = STARTING … (\d+) = FAILED\)", (GRAFANA.parents[1] / "docs" / "observability.md").read_text()
    )
    assert said is not None, "docs/observability.md no longer says which number is FAILED"
    assert (codes["STARTING"], said[1]) == ("1", codes["FAILED"])
