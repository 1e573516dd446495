#!/usr/bin/env bash
# `make test-clients`: the RL trainers' own HTTP client code drives the proxy in front of the simulator
# (tests/clients; docs/guides/ say which calls, with which client version).
#
# The trainers' packages come from the cached site directory scripts/clients-site.sh installs
# (pip install --no-deps, outside the repo); see that file for what is pinned and where it lives.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin

source scripts/clients-site.sh

log() { echo "[test-clients $(date +%T)] $*" >&2; }

if [[ ! -x $BIN/python ]]; then
  log "no virtual environment at ${VENV:-.venv} (run make setup)"
  exit 2
fi

t0=$SECONDS
SITE=$(client_site "$BIN")
t_setup=$((SECONDS - t0))

# The tests append the client site to sys.path (tests/clients/stand_ins.py): the proxy, pytest and the
# openai SDK come from the dev venv.
export LIFEGUARD_CLIENTS_SITE=$SITE
t1=$SECONDS
rc=0
"$BIN/pytest" -m clients tests/clients -q -rfEs --durations=6 "$@" || rc=$?
log "setup ${t_setup}s, tests/clients $((SECONDS - t1))s (rc=$rc)"
exit $rc
