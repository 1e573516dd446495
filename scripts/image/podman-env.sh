#!/usr/bin/env bash
# Source it: makes podman usable for `make test-image` on a fresh Debian 12 machine (root, no Docker
# daemon, no systemd), without writing to /etc.
#   . scripts/image/podman-env.sh
# Installs podman/buildah/runc/debootstrap with apt when missing, then exports CONTAINERS_CONF (the
# project's containers.conf) and CONTAINERS_STORAGE_CONF (image storage kept under the cache dir, so
# layers and base images survive between CI runs).
LIFEGUARD_CACHE=${LIFEGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard}
PODMAN_HOME=$LIFEGUARD_CACHE/podman
_podman_env_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

_podman_env_log() { echo "[podman-env $(date +%T)] $*" >&2; }

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
    _podman_env_log "apt-get install podman buildah runc debootstrap"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc debootstrap; } >"${TMPDIR:-/tmp}/lifeguard-apt-podman.log" 2>&1; then
        cat "${TMPDIR:-/tmp}/lifeguard-apt-podman.log" >&2
        return 1 2>/dev/null || exit 1
    fi
fi

mkdir -p "$PODMAN_HOME/storage"
cat >"$PODMAN_HOME/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$PODMAN_HOME/storage"
runroot = "/run/vllm-lifeguard/podman"
CONF
export CONTAINERS_CONF=$_podman_env_here/containers.conf
export CONTAINERS_STORAGE_CONF=$PODMAN_HOME/storage.conf
export LIFEGUARD_CACHE
unset _podman_env_here
