"""The pod as Kubernetes would run it: `podman kube play` of the rendered single-gpu overlay (real
`kubectl kustomize`), with tests/image/pod swapping vllm/vllm-openai for a vLLM-for-CPU image built
here and dropping the GPU resources. The pod runs in its own network namespace (loopback only); the
tests speak to it from inside that namespace, as a client on the pod network would reach the pod IP.
podman_kube.py lists what podman needs changed first (the native sidecar among them)."""

from __future__ import annotations

import http.client
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.image.image_helpers import Client, completion_body, inspect, podman, report, required_env, wait_for
from tests.image.podman_kube import drop_container_ports, expand_dependent_env, for_podman, pod_spec

pytestmark = pytest.mark.timeout(300)
POD = "vllm-pod-0"  # podman names the pod of Deployment "vllm" like this
SIDECAR, VLLM = f"{POD}-lifeguard", f"{POD}-vllm"
VLLM_START_S = 240  # a vLLM-for-CPU start on 2 cores, with margin


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    path = Path(required_env("LIFEGUARD_POD_YAML"))
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def play(documents: list[dict[str, Any]], tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "pod.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    podman("pod", "rm", "-f", "--time", "0", POD, check=False)
    return podman("kube", "play", "--network", "none", str(path), check=False, timeout=180)


def test_podman_cannot_run_the_native_sidecar(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    """Finding pinned: everything podman needs except moving the sidecar, and podman refuses it."""
    documents = yaml.safe_load(yaml.safe_dump(rendered))
    spec = pod_spec(documents)
    expand_dependent_env(spec)
    drop_container_ports(spec)
    try:
        result = play(documents, tmp_path)
        assert result.returncode != 0, "podman now runs native sidecars: revisit podman_kube.py and the README"
        assert "cannot create an init container that has either of lifecycle, livenessProbe" in result.stderr
    finally:
        podman("pod", "rm", "-f", "--time", "0", POD, check=False)


@pytest.fixture(scope="module")
def pod(rendered: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    documents = yaml.safe_load(yaml.safe_dump(rendered))
    for_podman(documents)
    t0 = time.monotonic()
    result = play(documents, tmp_path_factory.mktemp("pod"))
    assert result.returncode == 0, result.stderr
    client = Client(8080, netns_pid=int(inspect(SIDECAR, "{{.State.Pid}}")))
    try:
        wait_for("the sidecar's healthz", lambda: client.get("/lifeguard/healthz", timeout=2).status == 200, 30)
        report("pod_sidecar_healthy_s", round(time.monotonic() - t0, 1))
        client.wait_state("RUNNING", timeout=VLLM_START_S)
        report("pod_vllm_running_s", round(time.monotonic() - t0, 1))
        yield client
    finally:
        logs = podman("logs", "--tail", "40", VLLM, check=False)
        print(logs.stdout[-4000:], logs.stderr[-4000:])
        podman("pod", "rm", "-f", "--time", "5", POD, check=False)


def deployment_container(rendered: list[dict[str, Any]], name: str) -> dict[str, Any]:
    spec = pod_spec(rendered)
    (container,) = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    return container


def test_the_probes_pass_as_the_kubelet_runs_them(pod: Client, rendered: list[dict[str, Any]]) -> None:
    sidecar = deployment_container(rendered, "lifeguard")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        action = sidecar[probe]["httpGet"]
        assert action["port"] == "lifeguard"
        response = pod.get(action["path"], timeout=sidecar[probe].get("timeoutSeconds", 1))
        assert response.status == 200, (probe, response)
    vllm = deployment_container(rendered, "vllm")
    for probe in ("startupProbe", "livenessProbe"):
        result = podman("exec", VLLM, *vllm[probe]["exec"]["command"], check=False)
        assert result.returncode == 0, (probe, result.stderr)
    # podman's own conversion of those probes (recorded in deploy/k8s/README.md): httpGet becomes
    # `curl -f ...` inside the container (the lifeguard image has no curl), exec becomes a shell string
    # that loses the argument quoting, so neither healthcheck could pass.
    assert "curl" in inspect(SIDECAR, "{{json .Config.Healthcheck}}")
    assert podman("healthcheck", "run", SIDECAR, check=False).returncode != 0


def test_a_request_to_the_lifeguard_port_reaches_vllm(pod: Client) -> None:
    models = pod.get("/v1/models")
    assert models.status == 200, models
    assert (models.body["data"][0]["id"], models.body["data"][0]["owned_by"]) == ("tiny", "vllm"), models
    answer = pod.post("/v1/completions", completion_body(), timeout=120)
    assert answer.status == 200, answer
    assert answer.body["model"] == "tiny" and answer.body["choices"][0]["finish_reason"] == "length", answer
    metrics = pod.get("/metrics").body  # vLLM's own, relayed by the sidecar
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}' in metrics


def test_the_service_targets_the_sidecar_and_vllm_listens_on_loopback_only(
    pod: Client, rendered: list[dict[str, Any]]
) -> None:
    (service,) = [d for d in rendered if d["kind"] == "Service" and d["metadata"]["name"] == "vllm"]
    (port,) = service["spec"]["ports"]
    sidecar_ports = {p["name"]: p["containerPort"] for p in deployment_container(rendered, "lifeguard")["ports"]}
    vllm_ports = {p["containerPort"] for p in deployment_container(rendered, "vllm")["ports"]}
    assert sidecar_ports[port["targetPort"]] == 8080 and 8080 not in vllm_ports and 8000 in vllm_ports
    listening = podman("exec", SIDECAR, "cat", "/proc/net/tcp").stdout.splitlines()[1:]
    sockets = {(f[1], f[3]) for f in (line.split() for line in listening) if f[3] == "0A"}  # 0A: LISTEN
    assert ("00000000:1F90", "0A") in sockets  # 0.0.0.0:8080, the sidecar
    assert ("0100007F:1F40", "0A") in sockets  # 127.0.0.1:8000, vLLM
    assert not any(local.endswith(":1F40") and not local.startswith("0100007F") for local, _ in sockets)


def test_a_sleep_wake_cycle_through_the_pod(pod: Client) -> None:
    assert pod.post("/sleep?level=1", timeout=120).status == 200
    assert pod.state()["state"] == "SLEEPING"
    assert pod.get("/is_sleeping").body == {"is_sleeping": True}
    held = pod.start("POST", "/v1/completions", completion_body(), timeout=120)
    pod.wait_held(1)
    assert pod.post("/wake_up", timeout=120).status == 200
    assert held.result(120).status == 200
    assert pod.get("/is_sleeping").body == {"is_sleeping": False}
    assert pod.state()["state"] == "RUNNING"


class ReadinessProber:
    """The kubelet's readiness prober for one container, run from the pod's network: the probe's httpGet every
    `periodSeconds` (answered within `timeoutSeconds`, a status in 200-399), `failureThreshold` failures in a
    row to turn the container (and with it the Pod Ready condition) false, `successThreshold` successes to
    turn it true again. Every turn is recorded with its time."""

    def __init__(self, client: Client, probe: dict[str, Any]) -> None:
        self._client = client
        self._path = probe["httpGet"]["path"]
        self._period = float(probe.get("periodSeconds", 10))
        self._timeout = float(probe.get("timeoutSeconds", 1))
        self._thresholds = {False: int(probe.get("failureThreshold", 3)), True: int(probe.get("successThreshold", 1))}
        self.ready: bool | None = None
        self.turns: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReadinessProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._period + self._timeout + 5)

    def _passes(self) -> bool:
        try:
            return 200 <= self._client.get(self._path, timeout=self._timeout).status < 400
        except (OSError, http.client.HTTPException):  # TimeoutError is an OSError
            return False

    def _run(self) -> None:
        streak: tuple[bool, int] = (True, 0)
        while not self._stop.is_set():
            result = self._passes()
            streak = (result, streak[1] + 1 if streak[0] == result else 1)
            if self.ready is not result and streak[1] >= self._thresholds[result]:
                self.ready = result
                self.turns.append((time.monotonic(), result))
            self._stop.wait(self._period)

    def wait(self, ready: bool, timeout: float) -> float:
        """Seconds until the condition is `ready`."""
        started = time.monotonic()
        wait_for(f"Pod Ready {ready}", lambda: self.ready is ready, timeout, interval=0.05)
        return time.monotonic() - started


def test_pod_ready_follows_sleep_and_wake_as_the_kubelet_probes_it(pod: Client, rendered: list[dict[str, Any]]) -> None:
    """components/ready-when-serving: the sidecar's readinessProbe on /lifeguard/serving, run as the kubelet
    runs it, turns the pod's Ready condition false within one period of a /sleep of the real vLLM in the pod
    and true again within one period of the verified wake. What podman itself reports is recorded beside it:
    podman 4.3 runs no readiness probe, so none of this shows in `podman pod inspect` or `podman ps`."""
    probe = deployment_container(rendered, "lifeguard")["readinessProbe"]
    assert probe["httpGet"]["path"] == "/lifeguard/serving"
    podman_before = podman_readiness()
    with ReadinessProber(pod, probe) as kubelet:
        kubelet.wait(True, timeout=10)
        assert pod.post("/sleep?level=1", timeout=120).status == 200
        out_s = kubelet.wait(False, timeout=5 * probe["periodSeconds"])
        podman_asleep = podman_readiness()
        refused = pod.get("/lifeguard/serving", timeout=2)
        assert refused.status == 503 and refused.body["error"]["cause"] == "asleep", refused
        assert pod.post("/wake_up", timeout=120).status == 200
        back_s = kubelet.wait(True, timeout=5 * probe["periodSeconds"])
        turns = [ready for _, ready in kubelet.turns]
    assert turns == [True, False, True], kubelet.turns
    report("pod_ready_false_after_sleep_s", round(out_s, 2))
    report("pod_ready_true_after_wake_s", round(back_s, 2))
    # podman's own view did not move with the engine: it runs no readiness probe, and its healthcheck (its
    # conversion of the liveness probe: curl, which the image lacks) is never scheduled without systemd.
    assert podman_asleep == podman_before, (podman_before, podman_asleep)
    print(f"podman's view, awake and asleep alike: {podman_before}")


def podman_readiness() -> dict[str, str]:
    """Everything podman 4.3 says that could stand for readiness: the pod's and the sidecar's status, and the
    sidecar's health (its healthcheck)."""
    return {
        "pod": podman("pod", "inspect", POD, "--format", "{{.State}}").stdout.strip(),
        "sidecar": inspect(SIDECAR, "{{.State.Status}}"),
        "sidecar_health": inspect(SIDECAR, "{{.State.Health.Status}}"),
        "ps": ps_status_without_uptime(podman("ps", "--filter", f"name={SIDECAR}", "--format", "{{.Status}}").stdout),
    }


def ps_status_without_uptime(status: str) -> str:
    """`podman ps` says 'Up 53 seconds ago (starting)': the uptime moves every second whatever the engine
    does, so only the words after it (the health in brackets) can stand for readiness."""
    return re.sub(r"^Up .*? ago\b\s*", "Up ", status.strip()).strip()


def test_podman_uptime_is_not_taken_for_a_change_of_readiness() -> None:
    """Regression (CI of 2026-12-04): podman's view was compared with its uptime in it, 'Up 53 seconds ago
    (starting)' against 'Up 54 seconds ago (starting)', and failed with nothing changed but the clock."""
    assert ps_status_without_uptime("Up 53 seconds ago (starting)\n") == "Up (starting)"
    assert ps_status_without_uptime("Up About a minute ago (healthy)") == "Up (healthy)"
    assert ps_status_without_uptime("Up 2 minutes ago") == "Up"
    assert ps_status_without_uptime("Exited (0) 3 seconds ago") == "Exited (0) 3 seconds ago"


def test_the_gpu_reporter_file_path(pod: Client) -> None:
    """CPU build: the reporter finds no NVML and writes nothing; the sidecar says the probe is unavailable.
    Then the same reporter with an NVML stand-in writes through the shared emptyDir, and the sidecar
    (UID 10001, read-only mount) reads it."""
    logs = podman("logs", VLLM, check=False)
    assert "gpu-reporter: pynvml not installed" in logs.stdout + logs.stderr
    memory = pod.state()["gpu_memory"]
    assert memory["available"] is False and "/run/lifeguard/gpu.json" in memory["unavailable_reason"], memory
    fake = (
        "import types\n"
        "class NVMLError(Exception): pass\n"
        "nvmlInit = lambda: None\n"
        "nvmlDeviceGetCount = lambda: 1\n"
        "nvmlDeviceGetHandleByIndex = lambda i: i\n"
        "nvmlDeviceGetUUID = lambda h: b'GPU-fake-0'\n"
        "nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 << 30, total=80 << 30)\n"
    )
    script = (
        f"mkdir -p /tmp/fake-nvml && printf %s {shlex.quote(fake)} > /tmp/fake-nvml/pynvml.py && "
        "PYTHONPATH=/tmp/fake-nvml python3 /opt/lifeguard/gpu-reporter.py /run/lifeguard/gpu.json --once"
    )
    try:
        podman("exec", VLLM, "sh", "-c", script)
        memory = wait_for(
            "the sidecar reading the reporter's file",
            lambda: m if (m := pod.state()["gpu_memory"])["available"] else None,
            10,
        )
        assert memory["used_bytes"] == 3 << 30 and memory["total_bytes"] == 80 << 30, memory
    finally:
        podman("exec", VLLM, "rm", "-f", "/run/lifeguard/gpu.json", check=False)
    wait_for("the probe unavailable again", lambda: pod.state()["gpu_memory"]["available"] is False, 10)


def test_vllm_killed_and_restarted_failed_then_running_with_stale_weights(pod: Client) -> None:
    restarts = int(inspect(VLLM, "{{.RestartCount}}"))
    # The process dies (SIGKILL to vLLM, PID 1 of its container, by its host PID): a crash, which the
    # restart policy handles. `podman kill` would not do: podman counts it as a stop by the user.
    os.kill(int(inspect(VLLM, "{{.State.Pid}}")), signal.SIGKILL)
    failed = pod.wait_state("FAILED", timeout=30)
    assert failed["last_error"] is not None, failed
    refused = pod.post("/v1/completions", completion_body())
    assert refused.status == 503 and refused.headers.get("x-lifeguard-reason") == "engine_unavailable", refused
    t0 = time.monotonic()
    # The pod's restartPolicy (Always) restarts the container, as the kubelet would.
    state = pod.wait_state("RUNNING", timeout=VLLM_START_S)
    report("pod_vllm_restart_to_running_s", round(time.monotonic() - t0, 1))
    assert int(inspect(VLLM, "{{.RestartCount}}")) == restarts + 1
    assert state["weights_stale"] is True and state["weights_stale_reason"] == "restarted", state
    answer = pod.post("/v1/completions", completion_body(), timeout=120)
    assert answer.status == 200 and answer.headers.get("x-lifeguard-weights-stale"), answer.headers
