#!/usr/bin/env bash
# `make bench`: the performance table of docs/performance.md (direct / nginx proxy / vllm-lifeguard).
# Installs what it needs (nginx and wrk from Debian, pinned Python tools into the venv), then runs
# scripts/bench/run.py, which starts everything on loopback under a temp dir and stops it again.
# Usage: scripts/bench.sh [--quick] [--proxy-src DIR] [--json FILE] [--keep] [any run.py option]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
    echo "bench: installing nginx and wrk from Debian" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nginx wrk >/dev/null
fi
# uvloop drives the bench's own processes (run.py's load clients, the fake vLLM upstream.py); the proxy
# under test does not use it: `vllm-lifeguard serve` runs on asyncio's own loop (docs/performance.md says
# why). py-spy / pyinstrument are the profilers the closing notes were made with.
"$VENV/bin/pip" install -q uvloop==0.23.0 py-spy==0.4.3 pyinstrument==5.1.3

# 10,000 held requests need 10,000 client sockets here and as many in the proxy.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [ "$(ulimit -n)" -lt 12000 ]; then
    echo "bench: open-file limit $(ulimit -n) is too low for 10,000 held requests; using 4,000" >&2
    set -- --held 4000 "$@"
fi
exec "$VENV/bin/python" scripts/bench/run.py "$@"
