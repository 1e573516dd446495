#!/usr/bin/env bash
# make test-observability: the alert rules pass promtool, then a real Prometheus scrapes the proxy in
# front of the simulator and every dashboard panel and alert expression must return data.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}

# Debian's prometheus package brings promtool and the server (no daemon is started in a container:
# policy-rc.d denies it). apt-get update only when the package is not known to apt yet.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "installing Debian prometheus (promtool + server)"
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show prometheus >/dev/null 2>&1; then
        $SUDO apt-get update -qq >/dev/null
    fi
    $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

promtool check rules deploy/prometheus/lifeguard-rules.yaml
promtool test rules deploy/prometheus/lifeguard-rules.test.yaml

# -m prometheus overrides pyproject's addopts, which leave this marker out of `make test` (with the exposition's
# promtool check of tests/unit/observe/test_metrics.py).
"$VENV/bin/pytest" -m prometheus tests/observability tests/unit/observe/test_metrics.py -q -rP -p no:cacheprovider "$@"
