#!/usr/bin/env bash
# Source it: makes podman usable for `make test-image` on a fresh Debian 12 machine (root, no Docker
# daemon, no systemd), without writing to /etc.
#   . scripts/image/podman-env.sh
# Installs each of podman, conmon, runc, catatonit and debootstrap that is missing, with apt, by name; then
# exports CONTAINERS_CONF (the project's containers.conf) and CONTAINERS_STORAGE_CONF (image storage kept under the cache dir, so
# layers and base images survive between CI runs).
LIFEGUARD_CACHE=${LIFEGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard}
PODMAN_HOME=$LIFEGUARD_CACHE/podman
_podman_env_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

_podman_env_log() { echo "[podman-env $(date +%T)] $*" >&2; }

# Every binary the set-up and the tests run, and the Debian package that brings it. Each is checked and installed
# by name: catatonit (the pause binary `podman kube play` needs) is only a Recommends of podman, so a podman
# installed without recommends (a minimal image, another tool's install) lacks it and every pod test fails.
_podman_env_install() {
    local -A package_of=([podman]=podman [conmon]=conmon [runc]=runc [catatonit]=catatonit [debootstrap]=debootstrap)
    local binary log=${TMPDIR:-/tmp}/lifeguard-apt-podman.log
    local -a wanted=()
    for binary in "${!package_of[@]}"; do
        command -v "$binary" >/dev/null || wanted+=("${package_of[$binary]}")
    done
    ((${#wanted[@]} == 0)) && return 0
    _podman_env_log "apt-get install ${wanted[*]}"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}"; } >"$log" 2>&1; then
        cat "$log" >&2
        return 1
    fi
    for binary in "${!package_of[@]}"; do
        if ! command -v "$binary" >/dev/null; then
            _podman_env_log "$binary is still missing after apt-get install ${package_of[$binary]}"
            return 1
        fi
    done
}
if ! _podman_env_install; then
    unset -f _podman_env_install
    return 1 2>/dev/null || exit 1
fi
unset -f _podman_env_install

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
