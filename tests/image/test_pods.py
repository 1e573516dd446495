"""Two pods on one GPU as Kubernetes would run them: `podman kube play` of the rendered shared-gpu-pods overlay
(real `kubectl kustomize`), each pod a simulator (from the lifeguard image, tests/image/pods) and its lifeguard
sidecar, the pods sharing nothing but two host directories: the node's GPU lock directory (the overlay's
hostPath, made writable by its init container) and the simulated GPU's file (what NVML would read on a real
node). Each pod has its own network namespace; the tests speak to each from inside it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.image.image_helpers import Client, inspect, podman, report, required_env, wait_for
from tests.image.podman_kube import for_podman

pytestmark = pytest.mark.timeout(300)
ROLES = ("policy", "judge")
UUID = "GPU-kube-play-0"


def pod_name(role: str) -> str:
    return f"vllm-{role}-pod-0"  # podman names the pod of Deployment vllm-<role> like this


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    path = Path(required_env("LIFEGUARD_PODS_YAML"))
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def lock_dir() -> Path:
    return Path(required_env("LIFEGUARD_PODS_LOCK_DIR"))


def remove_pods() -> None:
    for role in ROLES:
        podman("pod", "rm", "-f", "--time", "2", pod_name(role), check=False)


@pytest.fixture(scope="module")
def pods(rendered: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Client]]:
    documents = yaml.safe_load(yaml.safe_dump(rendered))
    changes = for_podman(documents)
    assert "ResourceClaim vllm-shared-gpu not played" in changes
    path = tmp_path_factory.mktemp("pods") / "pods.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    remove_pods()
    t0 = time.monotonic()
    played = podman("kube", "play", "--network", "none", str(path), check=False, timeout=180)
    assert played.returncode == 0, played.stderr
    try:
        clients = {
            role: Client(8080, netns_pid=int(inspect(f"{pod_name(role)}-lifeguard", "{{.State.Pid}}")))
            for role in ROLES
        }
        for client in clients.values():
            client.wait_state("RUNNING", timeout=60)
        report("pods_running_s", round(time.monotonic() - t0, 1))
        yield clients
    finally:
        for role in ROLES:
            logs = podman("logs", "--tail", "30", f"{pod_name(role)}-lifeguard", check=False)
            print(role, logs.stdout[-3000:], logs.stderr[-3000:])
        remove_pods()


def asleep_everywhere(pods: dict[str, Client]) -> None:
    for client in pods.values():
        answer = client.post("/sleep?level=1", timeout=60)
        assert answer.status == 200, answer
        assert client.get("/is_sleeping").body == {"is_sleeping": True}


def test_the_lock_directory_was_made_writable_before_the_sidecars_started(
    pods: dict[str, Client], lock_dir: Path
) -> None:
    """The kubelet (here podman) creates the hostPath as root; the init container made it sticky and
    world-writable, so each sidecar (UID 10001) could check it at start and lock files in it."""
    assert lock_dir.stat().st_mode & 0o7777 == 0o1777
    for role, client in pods.items():
        state = client.state()
        lock = state["gpu_lock"]
        assert lock["dir"] == "/run/vllm-lifeguard/gpu-locks" and lock["host"] == pod_name(role), lock
        assert lock["gpus"]["0"]["uuid"] == UUID
        init = podman("inspect", "--format", "{{.State.ExitCode}}", f"{pod_name(role)}-gpu-lock-dir", check=False)
        assert init.stdout.strip() in ("0", ""), init  # podman removes a finished init container by default


def test_racing_wakes_through_the_two_pods_end_with_one_awake(pods: dict[str, Client], lock_dir: Path) -> None:
    """Both asleep; a wake sent to each pod's lifeguard at the same moment, three times: one wakes, the other
    is refused 503 insufficient_gpu_memory (memory held outside its proxy, by the other pod) and its engine
    stays asleep."""
    for round_ in range(3):
        asleep_everywhere(pods)
        racing = {role: client.start("POST", "/wake_up", timeout=60) for role, client in pods.items()}
        answers = {role: future.result(70) for role, future in racing.items()}
        awake = [role for role, answer in answers.items() if answer.status == 200]
        assert len(awake) == 1, (round_, answers)
        (loser,) = set(ROLES) - set(awake)
        refused = answers[loser]
        assert refused.status == 503 and refused.headers["x-lifeguard-reason"] == "insufficient_gpu_memory", refused
        assert "memory held outside this proxy" in refused.body["error"]["message"], refused
        sleeping = {role: client.get("/is_sleeping").body["is_sleeping"] for role, client in pods.items()}
        assert sleeping == {awake[0]: False, loser: True}, (round_, sleeping)
    assert (lock_dir / f"{UUID}.lock").is_file()


def test_a_wake_in_one_pod_holds_the_gpu_against_the_other_pod(pods: dict[str, Client]) -> None:
    """policy's wake made slow (2 s) in its simulator: while it runs, judge's lifeguard shows policy's pod as the
    holder of the GPU's lock, and judge's wake waits for it, then finds the memory taken."""
    asleep_everywhere(pods)
    simulator = Client(8000, netns_pid=pods["policy"].netns_pid)  # the simulator, on the pod's loopback
    assert simulator.post("/sim/faults", ["wake_up:slow:2"]).status == 200
    slow = pods["policy"].start("POST", "/wake_up", timeout=60)
    holder = wait_for(
        "judge's lifeguard seeing policy's pod hold the GPU",
        lambda: h if (h := pods["judge"].state()["gpu_lock"]["gpus"]["0"]["holder"]) else None,
        10,
        interval=0.05,
    )
    assert (holder["host"], holder["engine"], holder["op"]) == (pod_name("policy"), "policy", "wake_up"), holder
    t0 = time.monotonic()
    waited = pods["judge"].post("/wake_up", timeout=60)
    assert waited.status == 503 and waited.headers["x-lifeguard-reason"] == "insufficient_gpu_memory", waited
    assert slow.result(70).status == 200
    report("pods_wake_waited_for_other_pod_s", round(time.monotonic() - t0, 2))
    logs = podman("logs", f"{pod_name('judge')}-lifeguard", check=False)
    assert "gpu_lock_waited" in logs.stdout + logs.stderr and pod_name("policy") in logs.stdout + logs.stderr
    series = 'lifeguard_gpu_lock_waits_total{engine="judge",outcome="waited"} '
    (waits,) = [float(line.removeprefix(series)) for line in pods["judge"].get("/lifeguard/metrics").body.splitlines()
                if line.startswith(series)]  # fmt: skip
    assert waits >= 1


def test_only_the_kernel_holds_the_lock_no_file_to_clean_up(pods: dict[str, Client], lock_dir: Path) -> None:
    """Between transitions nothing is held: the lock file stays, empty of any holder's name."""
    for client in pods.values():
        gpu = client.state()["gpu_lock"]["gpus"]["0"]
        assert gpu["held"] is False and gpu["holder"] is None, gpu
    assert os.path.getsize(lock_dir / f"{UUID}.lock") == 0
