"""deploy/k8s: every overlay, alone and with each component, renders with the real kustomize (`kubectl
kustomize`) into valid Kubernetes objects with the sidecar wiring."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import Settings
from tests.deploy.kubectl_kustomize import build, find, pod_containers, read_kustomization

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
#: Several pods on one GPU (each pod a sub-kustomization, the ResourceClaim they share): tested per pod below.
PODS_OVERLAY = K8S / "overlays" / "shared-gpu-pods"
PODS = ("policy", "judge")
#: The overlays of one pod.
OVERLAYS = sorted(
    path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml") if path.parent != PODS_OVERLAY
)
COMPONENTS = sorted(path.parent for path in (K8S / "components").glob("*/kustomization.yaml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "lifeguard-dashboard.json"
# Native sidecars are on by default from 1.29; check the oldest supported and a current release.
K8S_VERSIONS = ["1.29", "1.33", "1.35"]
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
COMPONENT_ADDS = {
    "podmonitor": ("PodMonitor", "vllm-lifeguard"),
    "servicemonitor": ("ServiceMonitor", "vllm-lifeguard"),
    "prometheus-rule": ("PrometheusRule", "vllm-lifeguard"),
    "grafana-dashboard": ("ConfigMap", "vllm-lifeguard-dashboard"),
    "ready-when-serving": ("Service", "vllm-pods"),
    "network-policy": ("NetworkPolicy", "vllm-lifeguard"),
}
READY_WHEN_SERVING = K8S / "components" / "ready-when-serving"


def _ids(components: tuple[Path, ...]) -> str:
    return "+".join(c.name for c in components) or "alone"


def _kubernetes_validate() -> Any:
    """Installed by scripts/check-deploy.sh (make test-deploy), not by the dev extras; there it must be."""
    if os.environ.get("CHECK_DEPLOY") == "1":
        import kubernetes_validate

        return kubernetes_validate
    return pytest.importorskip("kubernetes_validate", reason="run scripts/check-deploy.sh (installs it)")


def _render(overlay: Path, *components: Path) -> list[dict[str, Any]]:
    return build(overlay, tuple(components))


def _pod(resources: list[dict[str, Any]]) -> dict[str, Any]:
    return find(resources, "Deployment", "vllm")["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item for item in container.get("env", [])}


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _lifeguard_env(resources: list[dict[str, Any]]) -> dict[str, str]:
    return find(resources, "ConfigMap", "vllm-lifeguard-config")["data"]


def _dra(resources: list[dict[str, Any]]) -> bool:
    """Dynamic Resource Allocation objects, which Kubernetes has from 1.32 on."""
    return any(doc["apiVersion"].startswith("resource.k8s.io/") for doc in resources)


def _gpus(pod: dict[str, Any], container: dict[str, Any], resources: list[dict[str, Any]]) -> int:
    """Devices a container gets: the device plugin's `nvidia.com/gpu`, or the devices of the DRA claims it names."""
    limits = container["resources"].get("limits", {})
    if "nvidia.com/gpu" in limits:
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        return int(limits["nvidia.com/gpu"])
    claims = {c["name"]: c for c in pod.get("resourceClaims", [])}
    count = 0
    for claim in container["resources"].get("claims", []):
        named = claims[claim["name"]]
        if "resourceClaimName" in named:  # one claim, named by several pods (resource.k8s.io/v1)
            requests = find(resources, "ResourceClaim", named["resourceClaimName"])["spec"]["devices"]["requests"]
            count += sum(int(r["exactly"].get("count", 1)) for r in requests)
        else:
            template = find(resources, "ResourceClaimTemplate", named["resourceClaimTemplateName"])
            count += sum(int(r.get("count", 1)) for r in template["spec"]["spec"]["devices"]["requests"])
    return count


def _vllm_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in pod["containers"] if c["name"].startswith("vllm")]


def test_there_are_a_single_gpu_a_tensor_parallel_a_shared_gpu_and_a_shared_gpu_pods_overlay() -> None:
    assert {overlay.name for overlay in OVERLAYS} == {"single-gpu", "tensor-parallel", "shared-gpu"}
    assert {p.parent.name for p in PODS_OVERLAY.glob("*/kustomization.yaml")} == {*PODS, "pod"}
    assert {component.name for component in COMPONENTS} == {
        "podmonitor",
        "servicemonitor",
        "prometheus-rule",
        "grafana-dashboard",
        "ready-when-serving",
        "network-policy",
    }


def test_the_grafana_component_points_at_the_shared_dashboard_file() -> None:
    component = K8S / "components" / "grafana-dashboard"
    (generator,) = read_kustomization(component)["configMapGenerator"]
    sources = [(component / entry.split("=", 1)[-1]).resolve() for entry in generator["files"]]
    assert sources == [DASHBOARD.resolve()]
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard.get("panels") or dashboard.get("rows"), "the dashboard has no panels"
    rendered = _render(OVERLAYS[0], component)
    config_map = find(rendered, "ConfigMap", "vllm-lifeguard-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["lifeguard-dashboard.json"]) == dashboard
    plain = ROOT / "deploy" / "grafana" / "configmap.yaml"
    if plain.is_file():  # the kubectl-apply variant: the same object
        expected = yaml.safe_load(plain.read_text())
        assert config_map["metadata"]["name"] == expected["metadata"]["name"]
        assert config_map["metadata"]["labels"] == expected["metadata"]["labels"]
        assert config_map["metadata"].get("annotations") == expected["metadata"].get("annotations")
        assert json.loads(expected["data"]["lifeguard-dashboard.json"]) == dashboard


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("components", [(), *((c,) for c in COMPONENTS), tuple(COMPONENTS)], ids=_ids)
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_each_rendered_overlay_validates_against_the_kubernetes_schemas(
    overlay: Path, components: tuple[Path, ...], version: str
) -> None:
    """Every overlay alone, with each component, and with all of them."""
    kubernetes_validate = _kubernetes_validate()
    rendered = _render(overlay, *components)
    if _dra(rendered) and tuple(map(int, version.split("."))) < (1, 32):
        pytest.skip(f"{overlay.name} claims its GPU through Dynamic Resource Allocation: Kubernetes >= 1.32")
    kinds = sorted(doc["kind"] for doc in rendered)
    assert kinds.count("Deployment") == 1 and "Service" in kinds and "ConfigMap" in kinds
    for component in components:  # each component added what it is for
        kind, name = COMPONENT_ADDS[component.name]
        find(rendered, kind, name)
    for doc in rendered:
        if doc["kind"] in CRD_KINDS:
            continue  # no bundled schema; checked structurally below
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_broken_manifest_does_fail_validation() -> None:
    """The validation above can fail: a typo'd field in the rendered Deployment is caught."""
    kubernetes_validate = _kubernetes_validate()
    rendered = _render(OVERLAYS[0])
    deployment = find(rendered, "Deployment", "vllm")
    _container(deployment["spec"]["template"]["spec"], "lifeguard")["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def _one_pod(rendered: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """The objects of one pod of the shared-gpu-pods overlay (its own, and the claim they share), named as the
    base names them (without the `-<role>` suffix): every check of one pod's wiring applies to it as is."""
    suffix = f"-{role}"
    hashed = re.compile(rf"^(.*){re.escape(suffix)}(-[a-z0-9]{{10}})?$")

    def unsuffixed(name: str) -> str:
        match = hashed.match(name)
        return match.group(1) + (match.group(2) or "") if match else name

    mine = []
    for doc in rendered:
        labels = doc["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/instance", role) != role:
            continue
        doc = json.loads(json.dumps(doc))
        doc["metadata"]["name"] = unsuffixed(doc["metadata"]["name"])
        for container in pod_containers(doc):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    source["configMapRef"]["name"] = unsuffixed(source["configMapRef"]["name"])
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in volume:
                volume["configMap"]["name"] = unsuffixed(volume["configMap"]["name"])
        mine.append(doc)
    return mine


@pytest.fixture(params=[*((o, None) for o in OVERLAYS), *((PODS_OVERLAY, role) for role in PODS)],
                ids=lambda p: p[0].name + (f":{p[1]}" if p[1] else ""))  # fmt: skip
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """One pod's objects: each single-pod overlay, and each pod of shared-gpu-pods."""
    overlay, role = request.param
    whole = _render(overlay, *COMPONENTS)
    return _one_pod(whole, role) if role else whole


def test_lifeguard_is_a_native_sidecar_with_no_gpu(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert [c["name"] for c in sidecars] == ["lifeguard"]
    assert "lifeguard" not in [c["name"] for c in pod["containers"]]
    resources = sidecars[0]["resources"]
    assert not any("gpu" in key for part in resources.values() for key in part)
    assert sidecars[0]["args"][0] == "serve"


def test_vllm_runs_the_official_image_in_dev_mode_with_sleep_on_loopback(rendered: list[dict[str, Any]]) -> None:
    vllm = _container(_pod(rendered), "vllm")
    image, _, tag = vllm["image"].partition(":")
    assert image == "vllm/vllm-openai"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"pin an exact vLLM release, not {tag!r}"
    args = vllm["args"]
    assert "--enable-sleep-mode" in args
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert _env(vllm)["VLLM_SERVER_DEV_MODE"]["value"] == "1"
    assert vllm["command"][-2].rstrip().endswith('exec vllm serve "$@"'), "vLLM must replace the shell (PID 1)"


def test_every_variable_in_vllm_args_is_defined(rendered: list[dict[str, Any]]) -> None:
    vllm = _container(_pod(rendered), "vllm")
    used = {name for arg in vllm["args"] for name in re.findall(r"\$\((\w+)\)", arg)}
    assert used and used <= set(_env(vllm))


def test_tensor_parallel_size_equals_the_gpus_requested(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    for vllm in _vllm_containers(pod):
        assert _env(vllm)["TENSOR_PARALLEL_SIZE"]["value"] == str(_gpus(pod, vllm, rendered)), vllm["name"]


def test_the_overlays_differ_in_gpu_count() -> None:
    counts = {}
    for overlay in OVERLAYS:
        rendered = _render(overlay)
        pod = _pod(rendered)
        counts[overlay.name] = [_gpus(pod, vllm, rendered) for vllm in _vllm_containers(pod)]
    assert counts["single-gpu"] == [1]
    assert counts["tensor-parallel"][0] > 1
    assert counts["shared-gpu"] == [1, 1]


def test_the_shared_gpu_overlay_puts_two_vllms_on_one_claimed_gpu_behind_one_lifeguard() -> None:
    """Two vLLM containers name one DRA claim (the device plugin gives a device to one container only), each
    on its own loopback port, and the lifeguard's engines are exactly those two, on the same GPU index."""
    rendered = _render(K8S / "overlays" / "shared-gpu")
    pod = _pod(rendered)
    vllms = _vllm_containers(pod)
    assert [c["name"] for c in vllms] == ["vllm", "vllm-judge"]
    assert [[claim["name"] for claim in c["resources"]["claims"]] for c in vllms] == [["gpu"], ["gpu"]]
    assert [c["name"] for c in pod["resourceClaims"]] == ["gpu"]
    for container in pod_containers(find(rendered, "Deployment", "vllm")):
        assert not any("nvidia.com/gpu" in part for part in container.get("resources", {}).values())
    ports = []
    for vllm in vllms:
        args = vllm["args"]
        assert args[args.index("--host") + 1] == "127.0.0.1" and "--enable-sleep-mode" in args
        assert _env(vllm)["VLLM_SERVER_DEV_MODE"]["value"] == "1"
        ports.append(int(args[args.index("--port") + 1]))
        for probe in ("startupProbe", "livenessProbe"):
            assert f"http://127.0.0.1:{ports[-1]}/health" in " ".join(vllm[probe]["exec"]["command"])
    engines = _engines_config(rendered)["engines"]
    assert [e["upstream"] for e in engines] == [f"http://127.0.0.1:{port}" for port in ports]
    assert {tuple(e["gpus"]) for e in engines} == {(0,)}


def _engines_config(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    """The YAML file named by LIFEGUARD_CONFIG, read from the ConfigMap the sidecar mounts there."""
    path = Path(_lifeguard_env(rendered)["LIFEGUARD_CONFIG"])
    pod = _pod(rendered)
    (mount,) = [m for m in _container(pod, "lifeguard")["volumeMounts"] if path.parent == Path(m["mountPath"])]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config: dict[str, Any] = yaml.safe_load(find(rendered, "ConfigMap", volume["configMap"]["name"])["data"][path.name])
    return config


def test_the_service_targets_the_proxy_port_only(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    lifeguard, vllm = _container(pod, "lifeguard"), _container(pod, "vllm")
    service = find(rendered, "Service", "vllm")
    targets = [port["targetPort"] for port in service["spec"]["ports"]]
    resolved = [_port(lifeguard, t) if isinstance(t, str) else t for t in targets]
    assert resolved == [_port(lifeguard, "lifeguard")]
    assert _port(vllm, "vllm") not in resolved + [port["port"] for port in service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= rendered_pod_labels(rendered).items()


def rendered_pod_labels(rendered: list[dict[str, Any]]) -> dict[str, str]:
    return find(rendered, "Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
@pytest.mark.parametrize("when_serving", [False, True], ids=["accepting", "ready-when-serving"])
def test_probes_liveness_is_the_proxy_alone_readiness_accepting_or_serving(overlay: Path, when_serving: bool) -> None:
    """Readiness is "accepting" (serve or hold), or with components/ready-when-serving "serving now"."""
    rendered = _render(overlay, *([READY_WHEN_SERVING] if when_serving else []))
    lifeguard = _container(_pod(rendered), "lifeguard")
    port = _port(lifeguard, "lifeguard")
    for probe, path in [
        ("startupProbe", "/lifeguard/healthz"),
        ("livenessProbe", "/lifeguard/healthz"),
        ("readinessProbe", "/lifeguard/serving" if when_serving else "/lifeguard/readyz"),
    ]:
        http = lifeguard[probe]["httpGet"]
        assert http["path"] == path, probe
        assert http["port"] in (port, "lifeguard"), probe
        assert "host" not in http, "kubelet probes go to the pod IP; a host would point elsewhere"
    readiness = lifeguard["readinessProbe"]
    if when_serving:  # out at the first 503 and back at the first 200, probed every second
        assert (readiness["periodSeconds"], readiness["failureThreshold"], readiness["successThreshold"]) == (1, 1, 1)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_ready_when_serving_keeps_every_pod_reachable_for_the_trainer(overlay: Path) -> None:
    """The Service lists ready pods only; the headless `vllm-pods` lists every pod (not ready ones too) on the
    sidecar's port, so a trainer can still wake a pod that left the Service."""
    rendered = _render(overlay, READY_WHEN_SERVING)
    service, pods = find(rendered, "Service", "vllm"), find(rendered, "Service", "vllm-pods")
    assert "publishNotReadyAddresses" not in service["spec"]
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["publishNotReadyAddresses"] is True
    assert pods["spec"]["selector"] == service["spec"]["selector"]
    assert pods["spec"]["selector"].items() <= rendered_pod_labels(rendered).items()
    lifeguard = _container(_pod(rendered), "lifeguard")
    (port,) = pods["spec"]["ports"]
    assert port["targetPort"] == "lifeguard" and port["port"] == _port(lifeguard, "lifeguard")


def test_vllm_probes_run_inside_its_container_because_it_binds_loopback(rendered: list[dict[str, Any]]) -> None:
    vllm = _container(_pod(rendered), "vllm")
    assert "readinessProbe" not in vllm, "a sleeping engine must not take the pod out of the Service"
    for probe in ("startupProbe", "livenessProbe"):
        assert "httpGet" not in vllm[probe], f"{probe}: kubelet's httpGet cannot reach 127.0.0.1 in the pod"
        assert "http://127.0.0.1:8000/health" in " ".join(vllm[probe]["exec"]["command"])


def test_the_admin_token_comes_from_a_secret(rendered: list[dict[str, Any]]) -> None:
    lifeguard = _container(_pod(rendered), "lifeguard")
    token = _env(lifeguard)["LIFEGUARD_ADMIN_TOKEN"]
    assert "value" not in token
    assert token["valueFrom"]["secretKeyRef"]["name"] == "vllm-lifeguard-admin"
    assert "LIFEGUARD_ADMIN_TOKEN" not in _lifeguard_env(rendered), "never put the token in a ConfigMap"


def test_config_map_references_resolve_to_generated_config_maps(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    names = {doc["metadata"]["name"] for doc in rendered if doc["kind"] == "ConfigMap"}
    referenced = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    for container in pod_containers(find(rendered, "Deployment", "vllm")):
        referenced |= {s["configMapRef"]["name"] for s in container.get("envFrom", []) if "configMapRef" in s}
    assert referenced and referenced <= names


def test_the_proxy_settings_in_the_config_map_are_valid_settings(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _lifeguard_env(rendered)
    fields = {f"LIFEGUARD_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields | {"LIFEGUARD_CONFIG"}, f"unknown settings: {set(env) - fields}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from_file = _engines_config(rendered) if "LIFEGUARD_CONFIG" in env else {}
    settings = Settings(**from_file)
    pod = _pod(rendered)
    lifeguard = _container(pod, "lifeguard")
    assert settings.port == _port(lifeguard, "lifeguard")
    assert settings.host == "0.0.0.0"
    upstreams = [settings.upstream] if settings.upstream else [engine.upstream for engine in settings.engines]
    expected = []
    for vllm in _vllm_containers(pod):
        vllm_port = vllm["args"][vllm["args"].index("--port") + 1]
        assert int(vllm_port) == _port(vllm, vllm["name"])
        expected.append(f"http://127.0.0.1:{vllm_port}")
    assert upstreams == expected


def test_the_gpu_file_is_written_by_vllm_and_read_by_the_sidecar(rendered: list[dict[str, Any]]) -> None:
    """NVML from the sidecar without a GPU: vLLM's container reports, the sidecar reads the file."""
    pod = _pod(rendered)
    lifeguard, vllm = _container(pod, "lifeguard"), _container(pod, "vllm")
    probe = _lifeguard_env(rendered)["LIFEGUARD_GPU_PROBE"]
    assert probe.startswith("file:")
    gpu_file = Path(probe.removeprefix("file:"))
    reporter_call = vllm["command"][-2]
    assert f"gpu-reporter.py {gpu_file} &" in reporter_call

    def volume_at(container: dict[str, Any], path: Path) -> str:
        mounts = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        assert mounts, f"{container['name']} has nothing mounted at {path}"
        return mounts[0]["name"]

    shared = volume_at(lifeguard, gpu_file)
    assert shared == volume_at(vllm, gpu_file)
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == shared)
    script = Path(reporter_call.split()[1])
    script_volume = next(v for v in pod["volumes"] if v["name"] == volume_at(vllm, script))
    config_map = find(rendered, "ConfigMap", script_volume["configMap"]["name"])
    assert script.name in config_map["data"]


def test_security_context_of_the_sidecar(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    context = _container(pod, "lifeguard")["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_termination_grace_covers_prestop_and_both_shutdowns(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    pre_stop = _container(pod, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    proxy_grace = float(_lifeguard_env(rendered).get("LIFEGUARD_SHUTDOWN_GRACE_S", Settings().shutdown_grace_s))
    vllm_shutdown_budget = 30
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + vllm_shutdown_budget + proxy_grace


def test_resources_are_set_for_every_container(rendered: list[dict[str, Any]]) -> None:
    for container in pod_containers(find(rendered, "Deployment", "vllm")):
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_monitors_scrape_proxy_and_vllm_metrics_through_the_proxy_port(overlay: Path) -> None:
    pod_monitor = find(_render(overlay, K8S / "components" / "podmonitor"), "PodMonitor", "vllm-lifeguard")
    rendered = _render(overlay, K8S / "components" / "servicemonitor")
    service_monitor = find(rendered, "ServiceMonitor", "vllm-lifeguard")
    for monitor, endpoints_key in [(pod_monitor, "podMetricsEndpoints"), (service_monitor, "endpoints")]:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        endpoints = monitor["spec"][endpoints_key]
        assert sorted(e["path"] for e in endpoints) == ["/lifeguard/metrics", "/metrics"]
    lifeguard = _container(_pod(rendered), "lifeguard")
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} == {"lifeguard"}
    _port(lifeguard, "lifeguard")
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= rendered_pod_labels(rendered).items()
    service = find(rendered, "Service", "vllm")
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= service_ports
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", [*OVERLAYS, PODS_OVERLAY], ids=lambda p: p.name)
def test_the_network_policy_admits_only_the_sidecars_port_of_every_pod(overlay: Path) -> None:
    """components/network-policy (docs/security.md): it selects every vLLM pod and opens the sidecar's port only."""
    rendered = _render(overlay, K8S / "components" / "network-policy")
    policy = find(rendered, "NetworkPolicy", "vllm-lifeguard")
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: NCCL is vLLM's workers dialling out
    deployments = [d for d in rendered if d["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), deployment["metadata"]["name"]
        sidecar = _container(deployment["spec"]["template"]["spec"], "lifeguard")
        (rule,) = policy["spec"]["ingress"]
        assert [port["port"] for port in rule["ports"]] == [_port(sidecar, "lifeguard")]


def test_overlays_use_plain_strategic_merge_patches_on_the_base() -> None:
    for overlay in OVERLAYS:
        data = read_kustomization(overlay)
        assert data["resources"][0] == "../../base"
        assert all((overlay / extra).is_file() for extra in data["resources"][1:]), "only files of its own"
        for patch in data["patches"]:
            assert set(patch) == {"path"}, "plain strategic-merge patch files only"
            body = yaml.safe_load((overlay / patch["path"]).read_text())
            find(build(BASE), body["kind"], body["metadata"]["name"])  # targets a base resource


def test_the_readme_pod_example_is_a_valid_pod_spec() -> None:
    """The README's "Put it in your pod" snippet: a pod spec with the same wiring as the manifests."""
    readme = (ROOT / "README.md").read_text() if (ROOT / "README.md").is_file() else ""
    match = re.search(r"## Put it in your pod.*?```yaml\n(.*?)```", readme, re.DOTALL)
    assert match, "README.md lost its 'Put it in your pod' section (a ```yaml block under that heading)"
    spec = yaml.safe_load(match.group(1).replace("<your-registry>", "registry.example.com"))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example"}, "spec": spec}
    kubernetes_validate = _kubernetes_validate()
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    lifeguard, vllm = _container(spec, "lifeguard"), _container(spec, "vllm")
    assert lifeguard["restartPolicy"] == "Always" and lifeguard in spec["initContainers"]
    assert vllm["args"][vllm["args"].index("--host") + 1] == "127.0.0.1"
    assert _env(lifeguard)["LIFEGUARD_UPSTREAM"]["value"].endswith(vllm["args"][vllm["args"].index("--port") + 1])
    assert lifeguard["readinessProbe"]["httpGet"]["path"] == "/lifeguard/readyz"
    assert lifeguard["livenessProbe"]["httpGet"]["path"] == "/lifeguard/healthz"
    # Who copies the snippet keeps the memory check and the state file (issue 41): the GPU reporter writes in the vLLM
    # container the file the sidecar reads, on a volume both mount, and the state file lives on an emptyDir.
    env = _env(lifeguard)
    probe = env["LIFEGUARD_GPU_PROBE"]["value"]
    assert probe.startswith("file:")
    report = Path(probe.removeprefix("file:"))
    assert "gpu-reporter.py" in " ".join(vllm["command"]) and str(report) in " ".join(vllm["command"])
    mounts = {m["name"]: m["mountPath"] for m in lifeguard["volumeMounts"]}
    vllm_mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    shared = {name for name, path in mounts.items() if path == str(report.parent) and vllm_mounts.get(name) == path}
    assert shared, "the sidecar and vLLM mount the GPU report's directory from one volume"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert all("emptyDir" in volumes[name] for name in shared)
    state_file = Path(env["LIFEGUARD_STATE_FILE"]["value"])
    (state_volume,) = [name for name, path in mounts.items() if state_file.is_relative_to(path)]
    assert "emptyDir" in volumes[state_volume]
    assert env["LIFEGUARD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True


# ----- several pods on one GPU (overlays/shared-gpu-pods, docs/gpu-sharing-across-pods.md)


@pytest.mark.parametrize("components", [(), tuple(COMPONENTS)], ids=_ids)
def test_the_shared_gpu_pods_overlay_validates_against_the_kubernetes_schemas(components: tuple[Path, ...]) -> None:
    """resource.k8s.io/v1 (a named ResourceClaim) is served from 1.34 on: checked against 1.35."""
    kubernetes_validate = _kubernetes_validate()
    rendered = _render(PODS_OVERLAY, *components)
    assert sorted(d["metadata"]["name"] for d in rendered if d["kind"] == "Deployment") == ["vllm-judge", "vllm-policy"]
    for doc in rendered:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, "1.35", strict=True)


def test_two_pods_name_one_resource_claim_and_mount_one_lock_directory_for_their_lifeguards() -> None:
    rendered = _render(PODS_OVERLAY)
    (claim,) = [d for d in rendered if d["kind"] == "ResourceClaim"]
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    assert [d for d in rendered if d["kind"] == "ResourceClaimTemplate"] == []  # a template is one claim per pod
    lock_paths = set()
    for role in PODS:
        pod = _pod(_one_pod(rendered, role))
        assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimName": claim["metadata"]["name"]}]
        for vllm in _vllm_containers(pod):
            assert vllm["resources"]["claims"] == [{"name": "gpu"}]
            assert not any("nvidia.com/gpu" in part for part in vllm["resources"].values())
        lock_dir = _lifeguard_env(_one_pod(rendered, role))["LIFEGUARD_GPU_LOCK_DIR"]
        lifeguard = _container(pod, "lifeguard")
        (mount,) = [m for m in lifeguard["volumeMounts"] if m["mountPath"] == lock_dir]
        assert not mount.get("readOnly")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["hostPath"]["type"] == "DirectoryOrCreate"
        lock_paths.add(volume["hostPath"]["path"])
        # The directory is made writable for the sidecar (UID 10001) before the sidecar starts.
        names = [c["name"] for c in pod["initContainers"]]
        opener = _container(pod, "gpu-lock-dir")
        assert names.index("gpu-lock-dir") < names.index("lifeguard") and "restartPolicy" not in opener
        assert [m["mountPath"] for m in opener["volumeMounts"]] == [lock_dir]
        assert lock_dir in opener["command"][-1] and "0o1777" in opener["command"][-1]
        assert opener["securityContext"]["allowPrivilegeEscalation"] is False
        assert opener["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert len(lock_paths) == 1, "both lifeguards must lock in one directory of the node"


def test_each_pods_service_selects_its_own_pod_only() -> None:
    rendered = _render(PODS_OVERLAY)
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    for service in (d for d in rendered if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        chosen = [
            name for name, d in deployments.items() if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert chosen == [service["metadata"]["name"]], (service["metadata"]["name"], chosen)


def test_each_pods_lifeguard_guards_its_engine_with_the_node_lock_and_a_known_footprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered = _render(PODS_OVERLAY)
    for role in PODS:
        mine = _one_pod(rendered, role)
        for name, value in _lifeguard_env(mine).items():
            monkeypatch.setenv(name, value)
        settings = Settings(**_engines_config(mine))
        assert settings.gpu_lock_dir == "/run/vllm-lifeguard/gpu-locks" and settings.gpu_probe.startswith("file:")
        (engine,) = settings.engines
        assert engine.name == role and engine.gpus == (0,) and engine.footprint_gib is not None
