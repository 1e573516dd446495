"""Start, stop and restart a real vLLM-for-CPU server (stdlib only).

Used two ways:

* imported by ``tests/vllm/conftest.py`` (``VllmServer``), one server per pytest session;
* as a launcher for suites that only need a URL (the conformance suite)::

      python scripts/vllm/vllm_server.py [--port N] [--log FILE] [--enable-lora]

  prints ``CONFORMANCE_ENGINE_URL=http://127.0.0.1:N`` once /health answers 200, then keeps
  the server up until it gets SIGTERM/SIGINT (or vLLM dies: exit 1), and stops it by PID.

Paths come from the environment that ``scripts/vllm/setup-vllm.sh`` prints:
``LIFEGUARD_VLLM_PYTHON`` (the vLLM venv's python), ``LIFEGUARD_VLLM_MODEL`` (tiny model dir),
``LIFEGUARD_VLLM_CLI`` (the ``vllm`` CLI shim; defaults to vllm_cli.py next to this file).

vLLM runs in its own process group (``start_new_session``): the API server spawns an EngineCore,
a worker and a resource tracker, and ``stop``/``kill`` signal the whole group.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVED_MODEL_NAME = "tiny"

# Environment every start gets (docs/real-vllm.md).
VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # mounts /sleep, /wake_up, /pause, weight routes, /collective_rpc
    "VLLM_HOST_IP": "127.0.0.1",  # keeps vLLM's internal ZMQ sockets on loopback
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (integer)
    "VLLM_CPU_CI_ENV": "1",  # skips warm-up
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# Flags both suites' servers get: --enable-scale-out mounts /inference/v1/generate, the rollout route of
# SkyRL, prime-rl and vime (vLLM 0.32 answers it 403 without the flag).
SUITE_ARGS = ("--enable-scale-out",)
# The launcher's --enable-lora (the conformance run's LoRA scenarios): runtime adapter loading, rank up to 8 (the
# adapter scripts/vllm/make_tiny_lora.py builds).
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, urllib.error.URLError):
        return None


class VllmDied(RuntimeError):
    pass


class VllmServer:
    """One vLLM API server (plus its engine processes) on a loopback port."""

    def __init__(
        self,
        python: str | None = None,
        model: str | None = None,
        cli: str | None = None,
        port: int | None = None,
        log_path: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
        served_model_name: str = SERVED_MODEL_NAME,
    ) -> None:
        self.served_model_name = served_model_name
        self.python = python or os.environ["LIFEGUARD_VLLM_PYTHON"]
        self.model = model or os.environ["LIFEGUARD_VLLM_MODEL"]
        self.cli = cli or os.environ.get("LIFEGUARD_VLLM_CLI") or str(HERE / "vllm_cli.py")
        self.port = port or free_port()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawned_at = 0.0
        self.starts: list[float] = []  # seconds from spawn to /health 200, per start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [
            self.python,
            self.cli,
            "serve",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "16384",
            "--enforce-eager",
            # On a CPU with AMX, bf16 makes vLLM pick its AMX attention kernel (vllm/v1/attention/backends/
            # cpu_attn.py `_get_attn_isa`), and a fresh server's worker dies of SIGILL (exit -4) on a first short
            # prompt there: float32 takes the vector path on every x86 CPU.
            "--dtype",
            "float32",
            "--enable-server-load-tracking",
            "--enable-prompt-tokens-details",
            *self.extra_args,
        ]

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 240.0) -> None:
        """Spawn vLLM and return once GET /health answers 200; raise VllmDied with the log tail."""
        self.spawn()
        self.wait_healthy(timeout)

    def spawn(self) -> None:
        """Spawn vLLM without waiting for it: two servers can start side by side (``wait_healthy`` each)."""
        if self.alive():
            raise RuntimeError(f"vLLM already running (pid {self.pid})")
        env = {**os.environ, **VLLM_ENV}
        self._spawned_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            stamp = time.strftime("%H:%M:%S")
            log.write(f"\n==== start {stamp} {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop()/kill() signal the whole tree
            )

    def wait_healthy(self, timeout: float = 240.0) -> None:
        """Return once the spawned vLLM answers GET /health 200, at most ``timeout`` s after its spawn."""
        assert self.proc is not None, "spawn() first"
        t0 = self._spawned_at
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self._reap_group()
                raise VllmDied(f"vLLM exited with rc={rc} before /health; log tail:\n{self.log_tail()}")
            if _http_status(self.url + "/health") == 200:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise VllmDied(f"vLLM not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.25)
        self.starts.append(time.monotonic() - t0)
        with open(self.log_path, "a") as log:
            log.write(f"==== healthy after {self.starts[-1]:.1f} s (pid {self.proc.pid}, port {self.port})\n")

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reap_group(self, timeout: float = 10.0) -> None:
        """SIGKILL whatever is left in the process group (spawned workers, resource tracker)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            self._signal_group(signal.SIGKILL)
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._reap_group()

    def kill(self) -> None:
        """Engine death: SIGKILL the whole group at once (no graceful shutdown)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self._reap_group()

    def wait_port_free(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", self.port))
                    return
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"port {self.port} still busy after {timeout} s")

    def restart(self, timeout: float = 240.0) -> None:
        """Stop (if still running) and start again on the same port."""
        self.stop()
        self.wait_port_free()
        self.start(timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--log", default=None, help="vLLM log file (default: a temp file)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--enable-lora", action="store_true", help="serve runtime-loaded LoRA adapters")
    args = ap.parse_args()
    if args.enable_lora:
        os.environ.update(LORA_ENV)
    extra_args = SUITE_ARGS + (LORA_ARGS if args.enable_lora else ())
    server = VllmServer(port=args.port, log_path=args.log, extra_args=extra_args)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"vLLM starting on {server.url}, log {server.log_path}", file=sys.stderr, flush=True)
    try:
        server.start(args.timeout)
    except VllmDied as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    print(f"vLLM healthy after {server.starts[-1]:.1f} s (pid {server.pid})", file=sys.stderr, flush=True)
    print(f"CONFORMANCE_ENGINE_URL={server.url}", flush=True)
    rc = 0
    try:
        while not stop.wait(0.5):
            if not server.alive():
                print(f"vLLM died; log tail:\n{server.log_tail()}", file=sys.stderr, flush=True)
                rc = 1
                break
    finally:
        server.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
