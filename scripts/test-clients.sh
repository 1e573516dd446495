#!/usr/bin/env bash
# `make test-clients`: the RL trainers' own HTTP client code drives the proxy in front of the simulator
# (tests/clients; docs/guides/ say which calls, with which client version).
#
# The trainers' packages pull in torch, Ray, vLLM and more, so they are installed with `pip install
# --no-deps` into a cached site directory, together with only the small packages their HTTP modules
# import. tests/clients imports only those modules (tests/clients/stand_ins.py names the few
# package-level imports it stands in for). The directory lives outside the repo:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/clients-<hash of the pins and this script>
# (override with LIFEGUARD_CLIENTS_HOME); a marker written last makes a second run reuse it at once.
# prime-rl and vime are not on PyPI (checked with `pip index versions`), so they are not run here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin

# The trainers, newest the index serves (skyrl) or the version the guides name (trl, areal).
TRAINERS=(skyrl==0.3.0 trl==1.16.0 areal==1.0.4)
# What their HTTP modules import beyond the proxy's own dev environment (aiohttp, openai, pydantic):
# TRL: requests (+ urllib3, certifi, charset-normalizer, idna); AReaL's http.py: httpx, tenacity,
# and colorlog through areal.utils.logging.
DEPS=(requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20
      httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 tenacity==9.2.1 colorlog==6.12.0)

log() { echo "[test-clients $(date +%T)] $*" >&2; }
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [[ ! -x $BIN/python ]]; then
  log "no virtual environment at ${VENV:-.venv} (run make setup)"
  exit 2
fi

key=$( { printf '%s\n' "${TRAINERS[@]}" "${DEPS[@]}"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)
SITE=${LIFEGUARD_CLIENTS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/clients-$key}
MARKER=$SITE/.lifeguard-ready
t0=$SECONDS

if [[ ! -f $MARKER ]]; then
  mkdir -p "$(dirname "$SITE")"
  exec 9>"$SITE.lock"
  flock 9
  if [[ ! -f $MARKER ]]; then
    log "installing ${TRAINERS[*]} (--no-deps) and ${#DEPS[@]} small deps into $SITE"
    rm -rf "$SITE"
    quiet "$BIN/pip" install -q --disable-pip-version-check --no-deps --target "$SITE" "${TRAINERS[@]}" "${DEPS[@]}" >&2
    echo "$key" > "$MARKER"
  fi
  flock -u 9
else
  log "reusing $SITE"
fi
t_setup=$((SECONDS - t0))

# The client site goes first on the path; the proxy, pytest and the openai SDK come from the dev venv.
export LIFEGUARD_CLIENTS_SITE=$SITE
t1=$SECONDS
rc=0
"$BIN/pytest" -m clients tests/clients -q -rfEs --durations=6 "$@" || rc=$?
log "setup ${t_setup}s, tests/clients $((SECONDS - t1))s (rc=$rc)"
exit $rc
