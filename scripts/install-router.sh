#!/usr/bin/env bash
# Installs vllm-router (vLLM's Rust router, the PyPI wheel, unmodified) into a venv of its own and prints the
# path of its executable. Its own venv because the wheel's launcher brings FastAPI, uvicorn and more that the
# project's venv must not get. Used by `make test-fleet` and `make test-vllm` (tests/fleet/fleet.py).
#   LIFEGUARD_ROUTER_BIN=$(bash scripts/install-router.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUTER=vllm-router==0.1.17
FLEET_VENV=${FLEET_VENV:-.venv-fleet}
PYTHON=${VENV:-.venv}/bin/python
marker="$FLEET_VENV/.installed-$ROUTER"
if [ ! -f "$marker" ]; then
    echo "install-router: pip install $ROUTER into $FLEET_VENV" >&2
    [ -x "$FLEET_VENV/bin/python" ] || "$PYTHON" -m venv "$FLEET_VENV"
    "$FLEET_VENV/bin/pip" install -q --disable-pip-version-check "$ROUTER" 2> >(grep -v "is ignored" >&2)
    touch "$marker"
fi
"$FLEET_VENV/bin/vllm-router" --help >/dev/null
echo "$PWD/$FLEET_VENV/bin/vllm-router"
