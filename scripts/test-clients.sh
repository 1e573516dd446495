#!/usr/bin/env bash
# `make test-clients`: the RL trainers' own HTTP client code drives the proxy in front of the simulator
# (tests/clients; docs/guides/ say which calls, with which client version). Two groups:
#
#   1. the project's venv (Python 3.11): SkyRL 0.3.0, TRL, AReaL, the openai SDK;
#   2. SkyRL 0.4.0, which needs Python >= 3.12: a venv of its own, $SKYRL04_VENV (default .venv-skyrl04), made
#      with an interpreter scripts/clients-python.sh finds or builds (from Debian's archive; ~4 min once), with
#      the project and its test extra installed; it runs tests/clients/test_skyrl_0_4.py alone.
#
# The trainers' packages come from cached site directories scripts/clients-site.sh installs (pip install
# --no-deps, outside the repo); see that file for what is pinned and where it lives. Both groups run; the
# script fails if either does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin
SKYRL04_VENV=${SKYRL04_VENV:-.venv-skyrl04}
SKYRL04_TESTS=tests/clients/test_skyrl_0_4.py

source scripts/clients-site.sh
source scripts/clients-python.sh

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
t1=$SECONDS
rc=0
LIFEGUARD_CLIENTS_SITE=$SITE "$BIN/pytest" -m clients tests/clients --ignore "$SKYRL04_TESTS" -q -rfEs \
  --durations=6 "$@" || rc=$?
log "setup ${t_setup}s, tests/clients (Python 3.11 group) $((SECONDS - t1))s (rc=$rc)"

# The SkyRL 0.4.0 group, in its own venv (scripts/clients-site.sh: skyrl04_venv).
t2=$SECONDS
rc04=0
if skyrl04_venv "$SKYRL04_VENV" && SITE04=$(client_site "$SKYRL04_VENV/bin" skyrl04); then
  t_setup04=$((SECONDS - t2))
  t3=$SECONDS
  LIFEGUARD_CLIENTS_SITE=$SITE04 "$SKYRL04_VENV/bin/pytest" -m clients "$SKYRL04_TESTS" -q -rfEs --durations=6 \
    "$@" || rc04=$?
  log "setup ${t_setup04}s, $SKYRL04_TESTS (SkyRL 0.4.0, $("$SKYRL04_VENV/bin/python" -V)) $((SECONDS - t3))s (rc=$rc04)"
else
  log "could not set up the SkyRL 0.4.0 group (a CPython >= 3.12, its venv or its client site)"
  rc04=1
fi
exit $((rc || rc04))
