"""The rig: the paths the same load goes through, and the processes behind them.

* direct: to the trivial upstream (nginx, fixed answers) or, for SSE and lifecycle, to the fake vLLM
  (`upstream.py`);
* the peers, each in front of both: nginx as a reverse proxy (one worker: one proxy process against one),
  Envoy (`envoy-proxy.yaml.in`, `--concurrency 1`) and vllm-router (vLLM's Rust router, round robin, one
  worker URL, one tokio worker thread; one router per upstream, as it takes one worker list); Envoy and
  vllm-router only when their executables are found in `peers_bin` (scripts/bench.sh installs them into
  the bench venv);
* lifeguard: `python -m proxy serve` from the checkout under test, one process, on the data plane
  `--data-plane` names (raw, the default, or aiohttp); and, for the non-streaming and SSE loads, a second
  one on `also_plane` (the other plane), measured as its own path.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import Proc, children, free_port, http, log, wait_until

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class LoadPath:
    """Where one path's load goes: the Rig attributes holding its ports and the process it measures."""

    port: str
    sse_port: str
    measured: str | None
    sse_measured: str | None


PATHS = {
    "direct": LoadPath(port="up_port", sse_port="sse_port", measured=None, sse_measured=None),
    "nginx": LoadPath(
        port="nginx_port", sse_port="nginx_sse_port", measured="nginx_worker", sse_measured="nginx_worker"
    ),
    "envoy": LoadPath(port="envoy_port", sse_port="envoy_sse_port", measured="envoy_pid", sse_measured="envoy_pid"),
    "vllm-router": LoadPath(
        port="router_port", sse_port="router_sse_port", measured="router_pid", sse_measured="router_sse_pid"
    ),
    "lifeguard": LoadPath(port="lg_port", sse_port="lg_port", measured="lg_pid", sse_measured="lg_pid"),
    "lifeguard-alt": LoadPath(
        port="lg_alt_port", sse_port="lg_alt_port", measured="lg_alt_pid", sse_measured="lg_alt_pid"
    ),
}
PEERS = ("nginx", "envoy", "vllm-router")


@dataclass
class Rig:
    workdir: Path
    proxy_src: Path
    up_port: int = field(default_factory=free_port)
    sse_port: int = field(default_factory=free_port)
    nginx_port: int = field(default_factory=free_port)
    nginx_sse_port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    nginx_worker: int = 0
    lg: Proc | None = None
    lg_port: int = 0
    data_plane: str = "raw"
    also_plane: str = ""  # a second lifeguard on this plane for the fixed and SSE loads ("": none)
    peers_bin: Path | None = None  # where the `envoy` and `vllm-router` executables are
    lg_alt: Proc | None = None
    lg_alt_port: int = 0
    envoy_port: int = field(default_factory=free_port)
    envoy_sse_port: int = field(default_factory=free_port)
    envoy_pid: int = 0
    router_port: int = field(default_factory=free_port)
    router_sse_port: int = field(default_factory=free_port)
    router_pid: int = 0
    router_sse_pid: int = 0
    paths: list[str] = field(default_factory=lambda: ["direct", "nginx"])

    def render(self, template: str, out: str, **values: int | str) -> Path:
        text = (HERE / template).read_text()
        for key, value in values.items():
            text = text.replace(f"@{key}@", str(value))
        path = self.workdir / out
        path.write_text(text)
        return path

    def start(self, name: str, argv: list[str], **kw: Any) -> Proc:
        proc = Proc(name, argv, self.workdir, **kw)
        self.procs.append(proc)
        return proc

    async def start_fixed(self) -> None:
        for sub in ("tmp-body", "tmp-proxy", "tmp-fastcgi", "tmp-uwsgi", "tmp-scgi"):
            (self.workdir / sub).mkdir(exist_ok=True)
        prefix = str(self.workdir)
        up = self.render("nginx-upstream.conf.in", "nginx-upstream.conf", PREFIX=prefix, PORT=self.up_port)
        self.start("nginx-upstream", ["nginx", "-p", prefix, "-e", f"{prefix}/nginx-e1.log", "-c", str(up)])
        self.start("fake-vllm", [sys.executable, str(HERE / "upstream.py"), "--port", str(self.sse_port)])
        px = self.render(
            "nginx-proxy.conf.in",
            "nginx-proxy.conf",
            PREFIX=prefix,
            PORT=self.nginx_port,
            PORT_SSE=self.nginx_sse_port,
            UPSTREAM_PORT=self.up_port,
            SSE_PORT=self.sse_port,
        )
        master = self.start("nginx-proxy", ["nginx", "-p", prefix, "-e", f"{prefix}/nginx-e2.log", "-c", str(px)])
        for port in (self.up_port, self.sse_port, self.nginx_port):
            await wait_until(functools.partial(_healthy, port), f"port {port}")
        workers = children(master.pid)
        if len(workers) != 1:
            raise RuntimeError(f"expected one nginx proxy worker, found {workers}")
        self.nginx_worker = workers[0]
        await self._start_envoy()
        await self._start_vllm_router()

    def peer(self, name: str) -> str | None:
        exe = self.peers_bin / name if self.peers_bin else None
        if exe is None or not exe.exists():
            log(f"{name} not found in {self.peers_bin}: its path is left out (scripts/bench.sh installs it)")
            return None
        return str(exe)

    async def _start_envoy(self) -> None:
        exe = self.peer("envoy")
        if exe is None:
            return
        config = self.render(
            "envoy-proxy.yaml.in",
            "envoy-proxy.yaml",
            PORT=self.envoy_port,
            PORT_SSE=self.envoy_sse_port,
            UPSTREAM_PORT=self.up_port,
            SSE_PORT=self.sse_port,
        )
        argv = [exe, "-c", str(config), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"]
        self.envoy_pid = self.start("envoy", argv).pid
        for port in (self.envoy_port, self.envoy_sse_port):
            await wait_until(functools.partial(_healthy, port), f"envoy on port {port}", timeout=60)
        self.paths.append("envoy")

    async def _start_vllm_router(self) -> None:
        """One router per upstream: its worker list is per process. Its admission queue and concurrency
        limit (100 by default) are lifted, so that 256 connections and 512 streams pass as through nginx;
        retries, the circuit breaker and the health checks' traffic are off."""
        exe = self.peer("vllm-router")
        if exe is None:
            return
        pids = []
        for name, port, upstream in (
            ("vllm-router", self.router_port, self.up_port),
            ("vllm-router-sse", self.router_sse_port, self.sse_port),
        ):
            argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
            argv += ["--worker-urls", f"http://127.0.0.1:{upstream}", "--log-level", "warning"]
            argv += ["--prometheus-port", str(free_port()), "--max-concurrent-requests", "100000"]
            argv += ["--queue-size", "100000", "--request-timeout-secs", "3600", "--disable-retries"]
            argv += ["--disable-circuit-breaker", "--health-check-interval-secs", "3600"]
            # One tokio worker thread, as nginx and Envoy get one worker: one proxy thread against one.
            pids.append(self.start(name, argv, env={"TOKIO_WORKER_THREADS": "1"}).pid)
        for port in (self.router_port, self.router_sse_port):
            await wait_until(functools.partial(_healthy, port), f"vllm-router on port {port}", timeout=60)
        self.router_pid, self.router_sse_pid = pids
        self.paths.append("vllm-router")

    async def start_lifeguard(self, upstream_port: int) -> Proc:
        return await self._start_lifeguard(["--upstream", f"http://127.0.0.1:{upstream_port}"])

    async def start_lifeguards(self, upstream_url: str) -> None:
        """The lifeguard under test on `data_plane` and, when `also_plane` is set, a second one on it."""
        await self._start_lifeguard(["--upstream", upstream_url])
        if "lifeguard" not in self.paths:
            self.paths.append("lifeguard")
        if self.also_plane and self.also_plane != self.data_plane:
            self.lg_alt, self.lg_alt_port = await self._launch(["--upstream", upstream_url], self.also_plane, "alt")
            if "lifeguard-alt" not in self.paths:
                self.paths.append("lifeguard-alt")

    async def start_lifeguard_engines(self, config: Path) -> Proc:
        """The proxy of several engines (`engines:` in `config`); ready once it has seen every engine."""
        return await self._start_lifeguard(["--config", str(config)])

    async def _start_lifeguard(self, target: list[str]) -> Proc:
        await self.stop_lifeguard()
        self.lg, self.lg_port = await self._launch(target, self.data_plane, "")
        return self.lg

    async def _launch(self, target: list[str], plane: str, suffix: str) -> tuple[Proc, int]:
        port = free_port()
        argv = [sys.executable, "-m", "proxy", "serve", *target]
        argv += ["--port", str(port), "--gpu-probe", "none", "--no-canary", "--log-level", "warning"]
        argv += ["--data-plane", plane]
        proc = self.start("lifeguard" + (f"-{suffix}" if suffix else ""), argv, cwd=self.proxy_src)

        async def running() -> bool:
            status, body = await http(port, "GET", "/lifeguard/state", timeout=2)
            if status != 200:
                return False
            state = json.loads(body)
            if "engines" in state:
                return all(e["state"] in ("RUNNING", "SLEEPING") for e in state["engines"].values())
            return bool(state["state"] == "RUNNING")

        try:
            await wait_until(running, "vllm-lifeguard to reach RUNNING")
        except RuntimeError:
            log(proc.tail())
            raise
        return proc, port

    async def stop_lifeguard(self) -> None:
        for proc in (self.lg, self.lg_alt):
            if proc is not None:
                proc.stop()
                self.procs.remove(proc)
        self.lg = self.lg_alt = None

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    @property
    def lg_pid(self) -> int | None:
        return self.lg.pid if self.lg is not None else None

    @property
    def lg_alt_pid(self) -> int | None:
        return self.lg_alt.pid if self.lg_alt is not None else None

    def port(self, path: str, *, sse: bool = False) -> int:
        row = PATHS[path]
        return int(getattr(self, row.sse_port if sse else row.port))

    def proxy_pid(self, path: str, *, sse: bool = False) -> int | None:
        """The process whose CPU and memory a run on `path` measures (none for direct)."""
        measured = PATHS[path].sse_measured if sse else PATHS[path].measured
        if measured is None:
            return None
        pid = getattr(self, measured)
        return int(pid) if pid else None


async def _healthy(port: int) -> bool:
    status, _ = await http(port, "GET", "/health")
    return status == 200
