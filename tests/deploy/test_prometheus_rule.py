"""deploy/k8s/components/prometheus-rule carries exactly the alerts of deploy/prometheus/lifeguard-rules.yaml (the one
source, tested by promtool), and the alerts about an engine keep its `engine` label."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from scripts import prometheus_rule
from tests.deploy.kubectl_kustomize import build, find

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "lifeguard-rules.yaml"
COMPONENT = ROOT / "deploy" / "k8s" / "components" / "prometheus-rule"
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "single-gpu"
#: The proxy's own series, about no engine (docs/architecture.md, "One owner for each number").
PROXY_WIDE = {"LifeguardProxyBug"}


def test_the_component_file_is_what_the_generator_writes_from_the_plain_rules() -> None:
    assert (COMPONENT / "prometheusrule.yaml").read_text() == prometheus_rule.render(RULES.read_text()), (
        "stale: run python3 scripts/prometheus_rule.py"
    )
    assert prometheus_rule.main(["--check"]) == 0


def test_the_rendered_prometheus_rule_has_the_plain_files_groups() -> None:
    rule = find(build(OVERLAY, (COMPONENT,)), "PrometheusRule", "vllm-lifeguard")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_every_alert_about_an_engine_keeps_and_names_the_engine() -> None:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]:
        if rule["alert"] in PROXY_WIDE:
            assert "engine" not in rule["expr"], rule["alert"]
            continue
        groupings = re.findall(r"\b(?:by|on) \(([^)]*)\)", rule["expr"])
        assert groupings, rule["alert"]
        for labels in groupings:
            assert {"namespace", "pod", "engine"} <= {label.strip() for label in labels.split(",")}, rule["alert"]
        assert "$labels.engine" in rule["annotations"]["summary"], rule["alert"]
