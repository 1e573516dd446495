#!/usr/bin/env bash
# Prints the Python base image for the Dockerfile's PYTHON_IMAGE (needs scripts/image/podman-env.sh).
#
# The official image (the Dockerfile's default) when a registry serves it; otherwise a local stand-in,
# localhost/python-base:3.11-bookworm: Debian 12 minbase + python3 (3.11) + venv + CA certificates, made
# with debootstrap from Debian's mirror (about 60 s) and kept as a tarball under the cache dir, so
# later runs only import it (a few seconds). It differs from python:3.11-slim-bookworm in where Python
# lives (/usr/bin, Debian's 3.11.2, instead of /usr/local, 3.11.x from python.org); the Dockerfile needs
# only `python` on PATH, groupadd/useradd, and `python -m venv`.
set -euo pipefail
OFFICIAL=${1:-python:3.11.14-slim-bookworm}
LOCAL=localhost/python-base:3.11-bookworm
INCLUDE=python3,python3-venv,ca-certificates
CACHE_DIR=$LIFEGUARD_CACHE/image
log() { echo "[base-image $(date +%T)] $*" >&2; }

if podman image exists "$OFFICIAL" || timeout 120 podman pull -q "$OFFICIAL" >/dev/null 2>&1; then
    log "using the official $OFFICIAL"
    echo "$OFFICIAL"
    exit 0
fi
log "no registry serves $OFFICIAL: using the local $LOCAL"

key=$( { echo "bookworm minbase $INCLUDE"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)
tarball=$CACHE_DIR/python-base-bookworm-$key.tar
if [[ $(podman image inspect --format '{{index .Labels "lifeguard.base-key"}}' "$LOCAL" 2>/dev/null) == "$key" ]]; then
    log "reusing $LOCAL (key $key)"
    echo "$LOCAL"
    exit 0
fi
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.base-image.lock"
flock 9
if [[ ! -f $tarball ]]; then
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-rootfs.XXXXXX")
    trap 'rm -rf "$rootfs" "$rootfs.log"' EXIT
    log "debootstrap --variant=minbase --include=$INCLUDE bookworm (about 60 s)"
    if ! debootstrap --variant=minbase --include="$INCLUDE" bookworm "$rootfs" >"$rootfs.log" 2>&1; then
        tail -20 "$rootfs.log" >&2
        exit 1
    fi
    ln -sf python3 "$rootfs/usr/bin/python"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    rm -f "$CACHE_DIR"/python-base-bookworm-*.tar
    tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
fi
log "importing $tarball"
podman import --quiet --change "LABEL lifeguard.base-key=$key" --change 'CMD ["python3"]' \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    "$tarball" "$LOCAL" >/dev/null
echo "$LOCAL"
