#!/usr/bin/env bash
# make test-ui: the status page (/lifeguard/ui) in Debian's headless Chromium, in front of the proxy and the
# simulator (tests/ui). Screenshots and the browser's log are kept in $LIFEGUARD_UI_ARTIFACTS (default build/ui/),
# which CI keeps as an artefact.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}

# Debian's chromium package; apt-get update only when the package is not known to apt yet.
if ! command -v chromium >/dev/null; then
    echo "installing Debian chromium"
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show chromium >/dev/null 2>&1; then
        $SUDO apt-get update -qq >/dev/null
    fi
    $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
chromium --version 2>/dev/null | head -1

export LIFEGUARD_UI_ARTIFACTS=${LIFEGUARD_UI_ARTIFACTS:-$PWD/build/ui}
rc=0
# -m ui overrides pyproject's addopts, which leave this marker out of `make test`.
"$VENV/bin/pytest" -m ui tests/ui -q -rfEs -p no:cacheprovider "$@" || rc=$?
echo "screenshots: $(ls "$LIFEGUARD_UI_ARTIFACTS"/*.png 2>/dev/null | tr '\n' ' ')"
exit $rc
