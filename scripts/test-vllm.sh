#!/usr/bin/env bash
# `make test-vllm`: the end-to-end suite against a real vLLM-for-CPU (docs/real-vllm.md).
#
#   1. scripts/vllm/setup-vllm.sh: the vLLM venv + tiny model in the user cache (~3 min once, then instant);
#   2. tests/vllm through the proxy: one vLLM per pytest session (plus one restart for engine death),
#      started with --enable-scale-out; test_vllm_clients.py drives it with the trainers' own client
#      modules, from the cached site scripts/clients-site.sh installs (if that install fails: in CI, CI=true,
#      the script fails at once; elsewhere those tests skip and say so);
#      test_vllm_skyrl_0_4.py (SkyRL 0.4.0, Python >= 3.12) then runs in the .venv-skyrl04 of make
#      test-clients, with a vLLM of its own;
#      test_vllm_fleet.py puts vllm-router (scripts/install-router.sh) in front of it and two simulators (the
#      same rule for a failed install);
#   3. tests/conformance (the simulator's conformance suite) against a second, dedicated real vLLM, started with
#      --enable-lora; its LoRA scenarios load an adapter of the tiny model (scripts/vllm/make_tiny_lora.py); then
#      tests/vllm/test_vllm_lora.py through a proxy in front of that same vLLM (an adapter across sleeps and wakes).
#
# A test that fails is run once more (pytest-rerunfailures, `-rR` lists it as a rerun): a real vLLM whose API
# server shares two cores with the proxy and the tests now and then answers later than any sane deadline, and
# one such late answer must not stop CI; a test that fails twice fails the suite. Every rerun is listed at the
# end with its test and its first failure's reason (here, and in .ci/run's summary, which counts them): a test
# that needs its rerun more than rarely is a defect to fix. Exits non-zero if either
# suite fails; each failure's message is printed again at the very end (scripts/vllm/failures.py). Logs (vLLM,
# proxies) go to $LIFEGUARD_VLLM_LOG_DIR (default: a fresh temp dir, printed at the end). Extra args are passed
# to the tests/vllm pytest run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin
t0=$SECONDS
log() { echo "[test-vllm $(date +%T)] $*" >&2; }

# The conformance suite against the real vLLM is half of this group: none to run is a failure, never a skip.
if ! compgen -G "tests/conformance/test_*.py" >/dev/null; then
  log "tests/conformance has no test_*.py: nothing to run against the real vLLM (a failure, not a skip)"
  exit 1
fi

setup_env=$(bash scripts/vllm/setup-vllm.sh) || { log "setup-vllm.sh failed"; exit 1; }
eval "$setup_env"
export LIFEGUARD_VLLM_PYTHON LIFEGUARD_VLLM_MODEL LIFEGUARD_VLLM_CLI
export LIFEGUARD_VLLM_LOG_DIR=${LIFEGUARD_VLLM_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-vllm.XXXXXX")}
mkdir -p "$LIFEGUARD_VLLM_LOG_DIR"
source scripts/clients-site.sh
source scripts/clients-python.sh
SKYRL04_VENV=${SKYRL04_VENV:-.venv-skyrl04}
SKYRL04_TESTS=tests/vllm/test_vllm_skyrl_0_4.py
# LoRA through the proxy: run against the conformance suite's vLLM, the one started with --enable-lora.
LORA_TESTS=tests/vllm/test_vllm_lora.py
# A failed install: in CI the group fails here (a skip would let CI pass with the coverage gone); elsewhere the
# tests that need it skip, and say so.
install_failed() {
  if [[ ${CI:-} == true ]]; then
    log "$1 failed: CI=true, so test-vllm fails (it does not skip $2)"
    exit 1
  fi
  log "$1 failed: $2 will skip (outside CI only)"
}
if LIFEGUARD_CLIENTS_SITE=$(client_site "$BIN"); then
  export LIFEGUARD_CLIENTS_SITE
else
  unset LIFEGUARD_CLIENTS_SITE
  install_failed "installing the trainers' client packages" tests/vllm/test_vllm_clients.py
fi
# vllm-router for tests/vllm/test_vllm_fleet.py.
if LIFEGUARD_ROUTER_BIN=$(bash scripts/install-router.sh); then
  export LIFEGUARD_ROUTER_BIN
else
  unset LIFEGUARD_ROUTER_BIN
  install_failed "installing vllm-router" tests/vllm/test_vllm_fleet.py
fi
export LIFEGUARD_FLEET_REPORT=$LIFEGUARD_VLLM_LOG_DIR/fleet-report.jsonl
: >"$LIFEGUARD_FLEET_REPORT"
t_setup=$((SECONDS - t0))

log "tests/vllm (through the proxy)"
t1=$SECONDS
# Under .ci/run, the group's record folder (its summary reads the JUnit XML there).
JUNIT=${LIFEGUARD_CI_RECORD:-$LIFEGUARD_VLLM_LOG_DIR/junit}
mkdir -p "$JUNIT"
"$BIN/pytest" -m vllm tests/vllm --ignore "$SKYRL04_TESTS" --ignore "$LORA_TESTS" -q -rfEsR --reruns 1 --durations=8 \
  --junitxml "$JUNIT/tests-vllm.xml" "$@"
rc_e2e=$?
t_e2e=$((SECONDS - t1))

# SkyRL 0.4.0 needs Python >= 3.12: its file runs in its own venv (the one make test-clients uses), with a
# vLLM of its own.
log "$SKYRL04_TESTS (SkyRL 0.4.0, its own venv)"
t3=$SECONDS
rc_skyrl04=0
if skyrl04_venv "$SKYRL04_VENV" && SITE04=$(client_site "$SKYRL04_VENV/bin" skyrl04); then
  LIFEGUARD_CLIENTS_SITE=$SITE04 "$SKYRL04_VENV/bin/pytest" -m vllm "$SKYRL04_TESTS" -q -rfEsR --reruns 1 \
    --durations=8 --junitxml "$JUNIT/skyrl04.xml" "$@"
  rc_skyrl04=$?
else
  log "could not set up the SkyRL 0.4.0 venv or its client site"
  rc_skyrl04=1
fi
t_skyrl04=$((SECONDS - t3))

rc_conf=0
log "tests/conformance against a real vLLM (with --enable-lora and a LoRA adapter of the tiny model)"
t2=$SECONDS
out=$LIFEGUARD_VLLM_LOG_DIR/conformance-launcher.out
lora=$LIFEGUARD_VLLM_LOG_DIR/tiny-lora
if ! "$LIFEGUARD_VLLM_PYTHON" scripts/vllm/make_tiny_lora.py "$LIFEGUARD_VLLM_MODEL" "$lora" >&2; then
  log "building the tiny model's LoRA adapter failed"
  rc_conf=1
fi
"$BIN/python" scripts/vllm/vllm_server.py --enable-lora --log "$LIFEGUARD_VLLM_LOG_DIR/vllm-conformance.log" >"$out" &
launcher=$!
stop_launcher() {
  if kill -0 "$launcher" 2>/dev/null; then
    kill -TERM "$launcher"
    wait "$launcher" 2>/dev/null
  fi
}
trap stop_launcher EXIT
url=
deadline=$((SECONDS + 300))
while [[ -z $url ]]; do
  url=$(sed -n 's/^CONFORMANCE_ENGINE_URL=//p' "$out")
  [[ -n $url ]] && break
  if ! kill -0 "$launcher" 2>/dev/null || ((SECONDS > deadline)); then
    log "vLLM for the conformance suite did not come up"
    tail -30 "$LIFEGUARD_VLLM_LOG_DIR/vllm-conformance.log" >&2
    rc_conf=1
    break
  fi
  sleep 0.5
done
rc_lora=1
if [[ -n $url && $rc_conf == 0 ]]; then
  CONFORMANCE_ENGINE_URL=$url CONFORMANCE_LORA_PATH=$lora "$BIN/pytest" tests/conformance -q -rfEsR --reruns 1 --junitxml "$JUNIT/conformance.xml"
  rc_conf=$?
  log "$LORA_TESTS through the proxy, on the same vLLM"
  LIFEGUARD_VLLM_LORA_ENGINE_URL=$url LIFEGUARD_VLLM_LORA_PATH=$lora "$BIN/pytest" -m vllm "$LORA_TESTS" -q -rfEsR --reruns 1 \
    --junitxml "$JUNIT/lora.xml"
  rc_lora=$?
fi
stop_launcher
trap - EXIT
t_conf=$((SECONDS - t2))

[[ -s $LIFEGUARD_FLEET_REPORT ]] && "$BIN/python" -m tests.fleet.fleet "$LIFEGUARD_FLEET_REPORT" >&2
log "setup ${t_setup}s, tests/vllm ${t_e2e}s (rc=$rc_e2e), SkyRL 0.4.0 ${t_skyrl04}s (rc=$rc_skyrl04)," \
  "conformance and LoRA ${t_conf}s (rc=$rc_conf, $rc_lora), total $((SECONDS - t0))s"
grep -h "^==== healthy after" "$LIFEGUARD_VLLM_LOG_DIR"/vllm*.log 2>/dev/null | sed 's/^==== /[test-vllm] vLLM /' >&2
log "logs in $LIFEGUARD_VLLM_LOG_DIR"
# Last, so that the tail of a CI log says why a test failed, not only which.
"$BIN/python" scripts/vllm/failures.py "$JUNIT"/*.xml >&2
if [[ -n ${LIFEGUARD_CI_RECORD:-} && -s $LIFEGUARD_CI_RECORD/reruns.jsonl ]]; then
  log "reruns (each test's first failure; a test that needs its rerun more than rarely is a defect):"
  "$BIN/python" -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("[test-vllm] RERUN " + r["test"] + ": " + r["reason"] + (" at " + r["where"] if r.get("where") else ""))
    for name, tail in r.get("logs", {}).items():
        print("[test-vllm]   " + name + ", its last lines at the failure:\n" + tail)' "$LIFEGUARD_CI_RECORD/reruns.jsonl" >&2
fi
((rc_e2e == 0 && rc_skyrl04 == 0 && rc_conf == 0 && rc_lora == 0))
