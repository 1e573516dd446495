"""Write deploy/k8s/components/prometheus-rule/prometheusrule.yaml from deploy/prometheus/lifeguard-rules.yaml.

The plain rule file is the one source of the alerts (promtool tests it: lifeguard-rules.test.yaml); the
Prometheus Operator's `PrometheusRule` carries the same `groups` under `spec`, comments included. Run after
editing the rules:

    python3 scripts/prometheus_rule.py          # rewrite the component's file
    python3 scripts/prometheus_rule.py --check  # exit 1 if it is stale (tests/deploy/test_prometheus_rule.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "lifeguard-rules.yaml"
TARGET = ROOT / "deploy" / "k8s" / "components" / "prometheus-rule" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/lifeguard-rules.yaml by scripts/prometheus_rule.py: edit that file, then run
# the script. tests/deploy/test_prometheus_rule.py fails when the two differ.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: vllm-lifeguard
  labels:
    app.kubernetes.io/name: vllm-lifeguard
spec:
"""


def render(rules: str) -> str:
    """The PrometheusRule: the plain file's lines from `groups:` on, indented under `spec:`."""
    lines = rules.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "\n".join(("  " + line) if line.strip() else "" for line in lines[start:])
    return HEADER + body + "\n"


def main(argv: list[str]) -> int:
    wanted = render(RULES.read_text())
    if "--check" in argv:
        if not TARGET.is_file() or TARGET.read_text() != wanted:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python3 scripts/prometheus_rule.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(wanted)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
