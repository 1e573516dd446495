#!/usr/bin/env bash
# Prove the proxy's physical (NVML) check on a real GPU, in well under 3 minutes.
#
# Starts the simulator with real GPU memory (`vllm-lifeguard sim --memory cuda`: its weights and KV pool
# are torch allocations of a few GiB each on cuda:0), runs `vllm-lifeguard serve --gpu-probe nvml` in
# front of it, and scripts/gpu_check.py checks that an honest sleep/wake passes verification with the
# memory the proxy read, that vLLM 0.34's checkpoint prepare and restore (the simulator's 0.34 profile) release and map
# back the KV cache, verified by the memory the proxy read and vLLM's snapshot check, and that a lying sleep and a lying wake (the simulator's lie-memory fault) are
# each answered 503 verification_failed with the true state kept. The figures (device memory before/after
# each step, what the proxy read, verification seconds) go to $OUT/gpu-check.json, or ./gpu-check.json
# when $OUT is unset. Then two such simulators on the same GPU behind one proxy of `engines:` (each engine's
# memory its own processes', NVML's per-process list): both put to sleep at once, one lying, which its own
# memory check must catch while the other's honest sleep moves the device; figures in gpu-check-engines.json.
#
# Before the lies, `vllm-lifeguard check --lifecycle` runs its physical rows against that simulator and proxy, both
# columns (figures in gpu-check-matrix.json).
#
# Then two pods on the GPU (docs/gpu-sharing-across-pods.md): two such simulators, each behind its own proxy
# (`--gpu-probe nvml`), the proxies sharing one `gpu_lock_dir`, each sized to take 55% of the device awake (one
# fits, two do not). gpu_check.py races a wake through both proxies, three times: one wakes, the other is
# refused 503 insufficient_gpu_memory before its simulator is asked. Figures: $OUT/gpu-check-pods.json.
#
# Without CUDA (no torch or no GPU), or with --dry-run, the same steps run against the simulator's
# simulated memory (`--memory simulated --gpu-file`) and the proxy's `--gpu-probe file:` probe, and the
# report says the physical check was unavailable. The device machine has torch, nvidia-ml-py, aiohttp and prometheus-client; the proxy's
# other pure-Python packages must travel with the tree: put them in .gpu-deps/ (for example
# `pip install --target .gpu-deps transitions pydantic-settings[yaml] uvloop`), which is added to PYTHONPATH.
#
# Usage: scripts/gpu-check.sh [--dry-run]      env: PYTHON, WEIGHTS_GIB (4), KV_GIB (4), GPU_CHECK_TIMEOUT_S (150)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${ROOT:+:}$ROOT/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-.}"
REPORT="$OUT_DIR/gpu-check.json"
WORK="$(mktemp -d)"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-150}"
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() {  # URL SECONDS PID: bounded wait for a 200, giving up early when the process died
  local url="$1" deadline=$((SECONDS + $2)) pid="$3"
  until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' "$url" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "gpu-check: process for $url exited; log:" >&2; cat "$WORK"/*.log >&2; exit 1; fi
    if ((SECONDS > deadline)); then echo "gpu-check: $url not up within $2 s" >&2; cat "$WORK"/*.log >&2; exit 1; fi
    sleep 0.2
  done
}

MODE=gpu
if ((DRY_RUN)); then
  MODE=dry-run; WHY="--dry-run asked"
elif ! WHY="$("$PYTHON" scripts/gpu_check.py cuda 2>&1)"; then
  MODE=dry-run
fi
ENGINE_PORT="$(free_port)"
PROXY_PORT="$(free_port)"
if [[ "$MODE" == gpu ]]; then
  ENGINE_ARGS=(--memory cuda)
  PROBE=nvml
  VERIFY_TIMEOUT_S=5  # cudaFree + empty_cache shows in NVML at once; a lie waits out the whole deadline
  PHYSICAL="{\"available\": true, \"device\": $("$PYTHON" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$WHY")}"
else
  ENGINE_ARGS=(--memory simulated --gpu-file "$WORK/gpu.json")
  PROBE="file:$WORK/gpu.json"
  VERIFY_TIMEOUT_S=1
  PHYSICAL="{\"available\": false, \"reason\": $("$PYTHON" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$WHY")}"
  echo "gpu-check: no physical check ($WHY); dry run with --gpu-probe $PROBE" >&2
fi

"$PYTHON" -m proxy sim --port "$ENGINE_PORT" --log-level warning --vllm-version 0.34 \
  --weights-gib "${WEIGHTS_GIB:-4}" --kv-gib "${KV_GIB:-4}" "${ENGINE_ARGS[@]}" >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ENGINE_PORT/health" 60 "${PIDS[0]}"

LIFEGUARD_RECONCILE_INTERVAL_S=0.5 LIFEGUARD_VERIFY_TIMEOUT_S=$VERIFY_TIMEOUT_S LIFEGUARD_LOG_LEVEL=warning \
  "$PYTHON" -m proxy serve --upstream "http://127.0.0.1:$ENGINE_PORT" --port "$PROXY_PORT" \
  --gpu-probe "$PROBE" >"$WORK/proxy.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PROXY_PORT/lifeguard/healthz" 30 "${PIDS[1]}"

# The physical rows of `vllm-lifeguard check` (docs/check.md): level-1 and level-2 cycles with the canary, and the
# device memory at a sleep and a wake, on the simulator itself and through the proxy: $OUT_DIR/gpu-check-matrix.json.
wait_http "http://127.0.0.1:$PROXY_PORT/lifeguard/serving" 30 "${PIDS[1]}"  # RUNNING: --lifecycle wants it idle
set +e
timeout 90 "$PYTHON" -m proxy check "http://127.0.0.1:$PROXY_PORT" --lifecycle --gpu-probe "$PROBE" --json \
  --row sleep-wake-level-1 --row sleep-wake-level-2 --row memory-follows-sleep >"$OUT_DIR/gpu-check-matrix.json"
rc_matrix=$?
set -e
((rc_matrix == 0)) || echo "gpu-check: the check's matrix exited $rc_matrix ($OUT_DIR/gpu-check-matrix.json)" >&2

EXTRA="{\"mode\": \"$MODE\", \"gpu_probe\": \"${PROBE%%:*}\", \"physical\": $PHYSICAL}"
set +e
timeout "$TIMEOUT_S" "$PYTHON" scripts/gpu_check.py check \
  --proxy "http://127.0.0.1:$PROXY_PORT" --engine "http://127.0.0.1:$ENGINE_PORT" \
  --out "$REPORT" --deadline-s $((TIMEOUT_S - 10)) --extra "$EXTRA"
rc=$?
set -e
if ((rc != 0)); then
  echo "--- proxy log" >&2; tail -n 40 "$WORK/proxy.log" >&2
  echo "--- simulator log" >&2; tail -n 40 "$WORK/engine.log" >&2
fi
for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
PIDS=()  # the single engine's memory is given back before the two engines take theirs

# --- two engines on one GPU, each verified against its own memory
CONFIG="$WORK/engines.yaml"
echo "engines:" >"$CONFIG"
ENGINE_URLS=()
for name in a b; do
  port="$(free_port)"
  if [[ "$MODE" == gpu ]]; then
    args=(--memory cuda)
  else
    args=(--memory simulated --gpu-file "$WORK/shared-gpu.json" --gpu-file-engine "$name")
  fi
  "$PYTHON" -m proxy sim --port "$port" --log-level warning --model "model-$name" \
    --weights-gib "${WEIGHTS_GIB:-4}" --kv-gib "${KV_GIB:-4}" "${args[@]}" >"$WORK/engine-$name.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/health" 60 "$!"
  echo "  - {name: $name, upstream: 'http://127.0.0.1:$port', gpus: [0], models: [model-$name]}" >>"$CONFIG"
  ENGINE_URLS+=(--engine "$name=http://127.0.0.1:$port")
done
[[ "$MODE" == gpu ]] || PROBE="file:$WORK/shared-gpu.json"
ENGINES_PORT="$(free_port)"
LIFEGUARD_RECONCILE_INTERVAL_S=0.5 LIFEGUARD_VERIFY_TIMEOUT_S=$VERIFY_TIMEOUT_S LIFEGUARD_LOG_LEVEL=warning \
  "$PYTHON" -m proxy serve --config "$CONFIG" --port "$ENGINES_PORT" --gpu-probe "$PROBE" >"$WORK/proxy-engines.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ENGINES_PORT/lifeguard/healthz" 30 "$!"
set +e
timeout "$TIMEOUT_S" "$PYTHON" scripts/gpu_check.py engines --proxy "http://127.0.0.1:$ENGINES_PORT" \
  "${ENGINE_URLS[@]}" --out "$OUT_DIR/gpu-check-engines.json" --deadline-s $((TIMEOUT_S - 10)) --extra "$EXTRA"
rc_engines=$?
set -e
if ((rc_engines != 0)); then
  echo "--- proxy of two engines log" >&2; tail -n 40 "$WORK/proxy-engines.log" >&2
fi
for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
PIDS=()  # the two engines' memory is given back before the two pods take theirs

# ----- two pods on the GPU, one gpu_lock_dir
mkdir "$WORK/gpu-locks"
if [[ "$MODE" == gpu ]]; then
  TOTAL_GIB="$("$PYTHON" -c 'import torch; print(torch.cuda.mem_get_info()[1] / (1 << 30))')"
  read -r POD_WEIGHTS POD_KV POD_GIB < <("$PYTHON" -c "t = float('$TOTAL_GIB'); print(round(t * 0.15, 1), round(t * 0.4, 1), round(t * 0.55, 1))")
  POD_PROBE=nvml
else
  POD_WEIGHTS=16; POD_KV=32; POD_GIB=50
  POD_PROBE="file:$WORK/pods-gpu.json"
fi
POD_SPECS=()
for pod in a b; do
  sim_port="$(free_port)"; proxy_port="$(free_port)"
  if [[ "$MODE" == gpu ]]; then
    sim_args=(--memory cuda)
  else  # one simulated 80 GiB device that both simulators' shares are written to (--gpu-file-engine)
    sim_args=(--memory simulated --gpu-file "$WORK/pods-gpu.json" --gpu-file-engine "$pod" --overhead-gib 2 --total-gib 80)
  fi
  "$PYTHON" -m proxy sim --port "$sim_port" --log-level warning --model "model-$pod" \
    --weights-gib "$POD_WEIGHTS" --kv-gib "$POD_KV" "${sim_args[@]}" >"$WORK/engine-$pod.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$sim_port/health" 120 "${PIDS[-1]}"
  # Asleep before the next one starts: two do not fit awake, not even while they start.
  "$PYTHON" -c 'import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1], method="POST"), timeout=60)' \
    "http://127.0.0.1:$sim_port/sleep?level=1"
  LIFEGUARD_ENGINES="[{\"name\": \"$pod\", \"upstream\": \"http://127.0.0.1:$sim_port\", \"gpus\": [0], \"footprint_gib\": $POD_GIB}]" \
  LIFEGUARD_GPU_LOCK_DIR="$WORK/gpu-locks" LIFEGUARD_RECONCILE_INTERVAL_S=0.5 LIFEGUARD_VERIFY_TIMEOUT_S=$VERIFY_TIMEOUT_S \
  LIFEGUARD_LOG_LEVEL=info "$PYTHON" -m proxy serve --port "$proxy_port" --gpu-probe "$POD_PROBE" >"$WORK/proxy-$pod.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$proxy_port/lifeguard/healthz" 30 "${PIDS[-1]}"
  POD_SPECS+=(--pod "$pod=http://127.0.0.1:$proxy_port,http://127.0.0.1:$sim_port")
done
set +e
timeout "$TIMEOUT_S" "$PYTHON" scripts/gpu_check.py pods "${POD_SPECS[@]}" --out "$OUT_DIR/gpu-check-pods.json" \
  --deadline-s $((TIMEOUT_S - 10)) --extra "{\"mode\": \"$MODE\", \"gpu_probe\": \"${POD_PROBE%%:*}\", \"pod_gib\": $POD_GIB}"
rc_pods=$?
set -e
if ((rc_pods != 0)); then
  for pod in a b; do echo "--- proxy $pod log" >&2; tail -n 30 "$WORK/proxy-$pod.log" >&2; done
fi
exit $((rc || rc_matrix || rc_engines || rc_pods))
