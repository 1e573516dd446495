#!/usr/bin/env bash
# `make chaos`: the reliability suites against the real processes.
#   1. the schemathesis run against the proxy's own API (docs/openapi.yaml): no 5xx made by the proxy;
#   2. the chaos run (tests/chaos/chaos_run.py): prints the figures, exits non-zero on a broken invariant.
#
#   bash scripts/chaos.sh                  # full run: 600 s of chaos (CHAOS_DURATION), >= 10,000 requests
#   bash scripts/chaos.sh --quick          # bounded CI run, under 3 minutes (also CHAOS_QUICK=1)
#   bash scripts/chaos.sh --duration 120   # any other length; more flags go to chaos_run.py (--seed, --strict, --keep)
#   bash scripts/chaos.sh --engines 2 --quick   # two engines on one simulated GPU, 110 s (make chaos-engines): the
#                                          # same invariants per engine, plus never more awake than fits
#   bash scripts/chaos.sh --pods 3 --quick      # three pods (a proxy and a simulator each) on one simulated GPU,
#                                          # one gpu_lock_dir, proxies killed -9 and restarted (make chaos-pods):
#                                          # also never two wakes overlapping on one GPU
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "chaos.sh: no virtual environment at $VENV (run make setup)" >&2
    exit 2
fi

if ! "$PY" -c "import schemathesis" 2>/dev/null; then
    "$VENV/bin/pip" install -q -r requirements-chaos.txt
fi

echo "== schemathesis against the proxy (docs/openapi.yaml)"
"$VENV/bin/pytest" -q -p no:cacheprovider -m chaos tests/e2e/test_bad_input.py -k schemathesis

echo "== chaos run"
exec "$PY" -m tests.chaos.chaos_run "$@"
