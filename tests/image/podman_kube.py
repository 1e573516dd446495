"""What has to change in a rendered Kubernetes manifest before podman 4.3 (Debian 12) runs it the way a
kubelet would. Each step is a difference between `podman kube play` and Kubernetes, measured on this
machine; deploy/k8s/README.md ("Run with podman") lists them.

    python tests/image/podman_kube.py RENDERED.yaml OUT.yaml [--keep-sidecar]
"""

from __future__ import annotations

import re
import sys
from typing import Any

import yaml

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def pod_spec(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (spec,) = pod_specs(documents)
    return spec


def pod_specs(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod template of each Deployment (podman plays each as a pod, `<name>-pod-0`)."""
    return [d["spec"]["template"]["spec"] for d in documents if d["kind"] == "Deployment"]


def sidecar_as_container(spec: dict[str, Any]) -> list[str]:
    """podman treats every initContainer as run-to-completion (it does not know the container-level
    `restartPolicy: Always` of native sidecars) and refuses one with probes: "cannot create an init
    container that has either of lifecycle, livenessProbe, readinessProbe, or startupProbe set". Without
    the probes it would wait for it to exit before starting vLLM, forever. So the sidecar becomes the
    first ordinary container; what is lost is Kubernetes' ordering (sidecar started and startup-probed
    before vLLM, stopped after it)."""
    moved = []
    remaining = []
    for container in spec.get("initContainers", []):
        if container.get("restartPolicy") == "Always":
            container.pop("restartPolicy")
            moved.append(container)
        else:
            remaining.append(container)
    spec["containers"] = moved + spec["containers"]
    if remaining:
        spec["initContainers"] = remaining
    else:
        spec.pop("initContainers", None)
    return [f"native sidecar {c['name']!r} moved to containers" for c in moved]


def _expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), text)


def expand_dependent_env(spec: dict[str, Any]) -> list[str]:
    """The kubelet expands $(VAR) in command and args from the container's env; podman passes the text
    literally (vLLM was started with the model "$(MODEL)")."""
    changes = []
    for container in spec["containers"] + spec.get("initContainers", []):
        values = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        for key in ("command", "args"):
            if key not in container:
                continue
            expanded = [_expand(arg, values) for arg in container[key]]
            if expanded != container[key]:
                changes.append(f"{container['name']}: $(VAR) expanded in {key}")
                container[key] = expanded
    return changes


def drop_container_ports(spec: dict[str, Any]) -> list[str]:
    """podman 4.3 publishes every containerPort on the host (hostPort defaults to containerPort) and so
    cannot run the pod in a private network namespace ("PortMappings can only be used with Bridge or
    slirp4netns networking"); Kubernetes publishes nothing. Named probe ports become numbers."""
    changes = []
    for container in spec["containers"] + spec.get("initContainers", []):
        ports = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
        if ports:
            changes.append(f"{container['name']}: ports {sorted(ports.values())} not published")
        for probe in PROBES:
            action = container.get(probe, {}).get("httpGet")
            if action and isinstance(action["port"], str):
                action["port"] = ports[action["port"]]
    return changes


def drop_resource_claims(documents: list[dict[str, Any]], spec: dict[str, Any]) -> list[str]:
    """podman 4.3 knows no Dynamic Resource Allocation: a pod's `resourceClaims`, the containers' `claims` and
    the ResourceClaim objects go (the pods that named one claim share a simulated GPU file instead)."""
    changes = []
    if spec.pop("resourceClaims", None):
        changes.append("resourceClaims dropped")
    for container in spec["containers"] + spec.get("initContainers", []):
        if container.get("resources", {}).pop("claims", None):
            changes.append(f"{container['name']}: resources.claims dropped")
    claims = [d for d in documents if d["apiVersion"].startswith("resource.k8s.io/")]
    for claim in claims:
        documents.remove(claim)
        changes.append(f"{claim['kind']} {claim['metadata']['name']} not played")
    return changes


def keep_init_containers(deployment: dict[str, Any]) -> list[str]:
    """podman 4.3 removes an init container of type `once` (its default) when it exits, and can race with that
    exit: "failed to remove once init container ...: cannot remove container ... as it is running" (measured
    with the shared-gpu-pods overlay's `gpu-lock-dir`). Type `always` keeps it, and it still runs to the end
    before the others start."""
    if not deployment["spec"]["template"]["spec"].get("initContainers"):
        return []
    # podman 4.3 reads it from the Deployment's own annotations, not its pod template's.
    deployment["metadata"].setdefault("annotations", {})["io.podman.annotations.init.container.type"] = "always"
    return [f"{deployment['metadata']['name']}: init containers of type always"]


def for_podman(documents: list[dict[str, Any]], keep_sidecar: bool = False) -> list[str]:
    changes = []
    for deployment in [d for d in documents if d["kind"] == "Deployment"]:
        spec = deployment["spec"]["template"]["spec"]
        changes += [] if keep_sidecar else sidecar_as_container(spec)
        changes += expand_dependent_env(spec) + drop_container_ports(spec) + drop_resource_claims(documents, spec)
        changes += keep_init_containers(deployment)
    return changes


def main(argv: list[str]) -> int:
    source, target = argv[0], argv[1]
    with open(source, encoding="utf-8") as handle:
        documents = [d for d in yaml.safe_load_all(handle) if d]
    for change in for_podman(documents, keep_sidecar="--keep-sidecar" in argv):
        print(f"podman_kube: {change}", file=sys.stderr)
    with open(target, "w", encoding="utf-8") as handle:
        yaml.safe_dump_all(documents, handle, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
