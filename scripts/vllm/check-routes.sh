#!/usr/bin/env bash
# `make test-vllm-routes`: the route table against the newest vLLM release, with no GPU and nothing installed.
#
#   1. `pip download --no-deps` the newest vLLM wheel (or VLLM_ROUTES_VERSION) into the user cache
#      (${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/wheels): a fresh machine fetches it once (~250-350 MB),
#      later runs find it there and only ask the index which release is the newest;
#   2. scripts/vllm/route_scan.py reads the routes of its vllm/entrypoints/** by an AST scan, straight from the
#      wheel, and fails on any route proxy/front/route_table.py does not classify.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BIN=${VENV:-.venv}/bin
CACHE=${LIFEGUARD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/wheels}
SPEC=vllm${VLLM_ROUTES_VERSION:+==$VLLM_ROUTES_VERSION}
log() { echo "[check-routes $(date +%T)] $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"  # two runs sharing a cache must not write the same file at once
flock 9
log "pip download --no-deps $SPEC into $CACHE"
out=$(timeout 900 "$BIN/pip" download --no-deps --only-binary=:all: --progress-bar off -d "$CACHE" "$SPEC" 2>&1) || {
  echo "$out" | grep -v "is ignored: it is neither a file nor a directory" >&2
  log "pip download failed"
  exit 2
}
wheel=$(echo "$out" | sed -n -e 's/^Saved \(.*\.whl\)$/\1/p' -e 's/^ *File was already downloaded \(.*\.whl\)$/\1/p' | tail -1)
if [[ -z $wheel || ! -f $wheel ]]; then
  echo "$out" >&2
  log "could not tell which wheel pip chose"
  exit 2
fi
log "scanning $(basename "$wheel")"
"$BIN/python" scripts/vllm/route_scan.py "$wheel"
