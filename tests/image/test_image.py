"""The image built from the Dockerfile, black box: podman runs it next to the simulator (run from the
same image as a second container, `vllm-lifeguard sim`), both on this machine's loopback (host network,
free ports). `make test-image` builds the image and runs this."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.image.image_helpers import (
    Client,
    completion_body,
    free_port,
    inspect,
    podman,
    report,
    required_env,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def image() -> str:
    return required_env("LIFEGUARD_TEST_IMAGE")


class Containers:
    """Containers started by one test, removed (by name) at its end."""

    def __init__(self, image: str, prefix: str) -> None:
        self.image = image
        self.prefix = prefix
        self.names: list[str] = []

    def run(self, role: str, *args: str, env: dict[str, str] | None = None, volumes: tuple[str, ...] = ()) -> str:
        name = f"{self.prefix}-{role}"
        options = ["run", "-d", "--name", name, "--network", "host"]
        for key, value in (env or {}).items():
            options += ["-e", f"{key}={value}"]
        for volume in volumes:
            options += ["-v", volume]
        self.names.append(name)
        podman(*options, self.image, *args)
        return name

    def remove_all(self) -> None:
        for name in self.names:
            podman("rm", "-f", "--time", "0", name, check=False)


@pytest.fixture
def containers(image: str, request: pytest.FixtureRequest) -> Iterator[Containers]:
    group = Containers(image, f"lg-image-{os.getpid()}-{request.node.name[:40].replace('_', '-')}")
    yield group
    group.remove_all()


@pytest.fixture
def gpu_dir(tmp_path: Path) -> Path:
    """Shared by the simulator (writes its GPU memory there) and the proxy (reads it: file: probe)."""
    path = tmp_path / "gpu"
    path.mkdir()
    path.chmod(0o777)  # both containers run as UID 10001
    return path


def start_sim(containers: Containers, gpu_dir: Path) -> int:
    port = free_port()
    containers.run("sim", "sim", "--port", str(port), "--gpu-file", "/gpu/gpu.json", volumes=(f"{gpu_dir}:/gpu",))
    wait_for("the simulator", lambda: Client(port).get("/health", timeout=2).status == 200, timeout=30)
    return port


def start_proxy(
    containers: Containers, gpu_dir: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[str, Client, float]:
    """Returns the container, a client, and the seconds from `podman run` until /lifeguard/readyz is 200."""
    if env is None:
        # The port through LIFEGUARD_PORT, not --port: the image's HEALTHCHECK probes $LIFEGUARD_PORT.
        env = {"LIFEGUARD_HOST": "127.0.0.1", "LIFEGUARD_PORT": str(free_port())}
        args = (*args, "--gpu-probe", "file:/gpu/gpu.json")
    port = int(env["LIFEGUARD_PORT"])
    t0 = time.monotonic()
    name = containers.run("proxy", *args, env=env, volumes=(f"{gpu_dir}:/gpu:ro",))
    client = Client(port)
    wait_for(
        "the proxy's /lifeguard/readyz", lambda: client.get("/lifeguard/readyz", timeout=2).status == 200, timeout=60
    )
    return name, client, time.monotonic() - t0


def test_image_runs_as_uid_10001_and_keeps_its_healthcheck(image: str) -> None:
    assert inspect(image, "{{.Config.User}}") == "10001:10001"
    assert json.loads(inspect(image, "{{json .Config.Entrypoint}}")) == ["vllm-lifeguard"]
    healthcheck = json.loads(inspect(image, "{{json .HealthCheck}}"))
    assert healthcheck and "/lifeguard/healthz" in " ".join(healthcheck["Test"]), healthcheck
    size = int(inspect(image, "{{.Size}}"))
    report("image_size_mb", round(size / 1e6))
    assert size < 400e6, f"the image grew to {size / 1e6:.0f} MB"


def test_serves_as_non_root_with_a_passing_healthcheck(containers: Containers, gpu_dir: Path) -> None:
    sim = start_sim(containers, gpu_dir)
    name, client, started = start_proxy(containers, gpu_dir, "serve", "--upstream", f"http://127.0.0.1:{sim}")
    report("start_to_ready_s", round(started, 2))
    assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
    assert "Uid:\t10001\t10001" in podman("exec", name, "cat", "/proc/1/status").stdout
    healthz = client.get("/lifeguard/healthz")
    assert (healthz.status, healthz.body) == (200, {"status": "ok"})

    # The image's own HEALTHCHECK command (podman schedules it with systemd timers, absent here, so run it).
    assert podman("healthcheck", "run", name, check=False).returncode == 0
    # It can fail: a stopped proxy loop does not answer within the check's timeout.
    podman("kill", "--signal", "STOP", name)
    try:
        stopped = podman("healthcheck", "run", name, check=False)
        assert stopped.returncode != 0 and "unhealthy" in stopped.stdout + stopped.stderr, stopped
    finally:
        podman("kill", "--signal", "CONT", name)
    assert podman("healthcheck", "run", name, check=False).returncode == 0


def test_sleep_wake_and_a_held_request_through_the_image(containers: Containers, gpu_dir: Path) -> None:
    sim = start_sim(containers, gpu_dir)
    _, client, _ = start_proxy(containers, gpu_dir, "serve", "--upstream", f"http://127.0.0.1:{sim}")
    assert client.post("/sleep?level=1").status == 200
    state = client.wait_state("SLEEPING", timeout=10)
    assert state["gpu_memory"]["available"], state["gpu_memory"]  # the sim's GPU file, read through the mount
    assert Client(sim).get("/is_sleeping").body == {"is_sleeping": True}

    held = client.start("POST", "/v1/completions", completion_body())
    client.wait_held(1)
    assert not held.done()
    assert client.post("/wake_up").status == 200
    answer = held.result(30)
    assert answer.status == 200 and answer.body["choices"][0]["text"], answer
    assert client.state()["state"] == "RUNNING"
    assert Client(sim).get("/is_sleeping").body == {"is_sleeping": False}


def test_sigterm_answers_a_held_request_503_shutting_down_and_exits_0(containers: Containers, gpu_dir: Path) -> None:
    sim = start_sim(containers, gpu_dir)
    name, client, _ = start_proxy(containers, gpu_dir, "serve", "--upstream", f"http://127.0.0.1:{sim}")
    assert client.post("/sleep?level=1").status == 200
    held = client.start("POST", "/v1/completions", completion_body())
    client.wait_held(1)

    t0 = time.monotonic()
    podman("stop", "--time", "60", name)  # SIGTERM, SIGKILL only after 60 s
    stop_seconds = time.monotonic() - t0
    answer = held.result(10)
    assert answer.status == 503, answer
    assert answer.headers.get("x-lifeguard-reason") == "shutting_down", answer.headers
    assert "retry-after" in answer.headers and answer.body["error"]["message"], answer
    assert inspect(name, "{{.State.ExitCode}}") == "0"
    assert stop_seconds < 30, f"stop took {stop_seconds:.1f} s: the SIGTERM did not end the proxy"
    report("sigterm_to_exit_s", round(stop_seconds, 2))


def test_settings_come_from_lifeguard_env(containers: Containers, gpu_dir: Path) -> None:
    sim = start_sim(containers, gpu_dir)
    port = free_port()
    env = {
        "LIFEGUARD_UPSTREAM": f"http://127.0.0.1:{sim}",
        "LIFEGUARD_HOST": "127.0.0.1",
        "LIFEGUARD_PORT": str(port),
        "LIFEGUARD_GPU_PROBE": "file:/gpu/gpu.json",
        "LIFEGUARD_ON_SLEEPING": "reject",
        "LIFEGUARD_LOG_FORMAT": "json",
    }
    name, client, _ = start_proxy(containers, gpu_dir, env=env)  # the image's CMD, no arguments
    state = client.state()
    assert state["upstream"] == env["LIFEGUARD_UPSTREAM"]
    assert state["policies"]["on_sleeping"] == "reject"
    assert state["gpu_memory"]["available"], state["gpu_memory"]
    assert client.post("/sleep?level=1").status == 200
    rejected = client.post("/v1/completions", completion_body())
    assert rejected.status == 503 and rejected.headers.get("x-lifeguard-reason") == "engine_sleeping", rejected
    logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=30)
    lines = [line for line in (logs.stdout + logs.stderr).splitlines() if line.startswith("{")]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines), (logs.stdout + logs.stderr)[-2000:]
