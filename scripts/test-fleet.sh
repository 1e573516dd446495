#!/usr/bin/env bash
# `make test-fleet`: vllm-router, unmodified, in front of three lifeguard + simulator pairs on loopback, under
# steady load, while one engine sleeps and wakes in cycles: once with vLLM's /health as the router's health
# check, once with /lifeguard/serving (tests/fleet/). Prints the figures of docs/fleets.md. About a minute.
# Logs go to $LIFEGUARD_FLEET_LOG_DIR (default: a fresh temp dir, printed at the end); extra args go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin
log() { echo "[test-fleet $(date +%T)] $*" >&2; }

LIFEGUARD_ROUTER_BIN=$(bash scripts/install-router.sh) || { log "installing vllm-router failed"; exit 1; }
export LIFEGUARD_ROUTER_BIN
export LIFEGUARD_FLEET_LOG_DIR=${LIFEGUARD_FLEET_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-fleet.XXXXXX")}
export LIFEGUARD_FLEET_REPORT=$LIFEGUARD_FLEET_LOG_DIR/report.jsonl
: >"$LIFEGUARD_FLEET_REPORT"
log "vllm-router: $LIFEGUARD_ROUTER_BIN"
# The test bounds itself (pytest-timeout 240 s, every wait with a deadline); this is the backstop.
timeout -k 10 300 "$BIN/pytest" -m fleet tests/fleet -q -rfEs -p no:cacheprovider "$@"
rc=$?
[ -s "$LIFEGUARD_FLEET_REPORT" ] && "$BIN/python" -m tests.fleet.fleet "$LIFEGUARD_FLEET_REPORT"
log "logs in $LIFEGUARD_FLEET_LOG_DIR"
exit $rc
