"""The rig: the paths the same load goes through, and the processes behind them.

* direct: to the trivial upstream (nginx, fixed answers) or, for SSE and lifecycle, to the fake vLLM
  (`upstream.py`);
* the peers, each in front of both: nginx as a reverse proxy (one worker: one proxy process against one),
  Envoy (`envoy-proxy.yaml.in`, `--concurrency 1`) and vllm-router (vLLM's Rust router, round robin, one
  worker URL, one tokio worker thread; one router per upstream, as it takes one worker list); Envoy and
  vllm-router only when their executables are found in `peers_bin` (scripts/bench.sh installs them into
  the bench venv);
* lifeguard: `python -m proxy serve` from the checkout under test, one process guarding one engine; for the
  non-streaming load also `lifeguard-2e`, the same proxy guarding two engines (`engines:`, both on the same
  upstream, requests routed by their `"model"`, alternating between the two); and, when `baseline_src`
  names another checkout (`--baseline-src`), `lifeguard-base`, that checkout's proxy, for before/after
  figures measured side by side in one run.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.procs import Proc, children, free_port, http, log, wait_until

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
    "lifeguard-2e": LoadPath(port="lg_2e_port", sse_port="lg_2e_port", measured="lg_2e_pid", sse_measured="lg_2e_pid"),
    "lifeguard-base": LoadPath(
        port="lg_base_port", sse_port="lg_base_port", measured="lg_base_pid", sse_measured="lg_base_pid"
    ),
}
#: The two engines' served names in `lifeguard-2e` (wrk alternates between them: WRK_MODELS).
TWO_ENGINE_MODELS = ("tiny", "tiny-judge")
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
    nginx_master: int = 0  # the process tree of nginx as a proxy: its master and its one worker
    lg: Proc | None = None
    lg_port: int = 0
    baseline_src: Path | None = None  # another checkout whose proxy runs beside (lifeguard-base)
    peers_bin: Path | None = None  # where the `envoy` and `vllm-router` executables are
    lg_2e: Proc | None = None
    lg_2e_port: int = 0
    lg_base: Proc | None = None
    lg_base_port: int = 0
    envoy_port: int = field(default_factory=free_port)
    envoy_sse_port: int = field(default_factory=free_port)
    envoy_pid: int = 0
    router_port: int = field(default_factory=free_port)
    router_sse_port: int = field(default_factory=free_port)
    router_pid: int = 0
    router_sse_pid: int = 0
    paths: list[str] = field(default_factory=lambda: ["direct", "nginx"])
    # lifeguard's `upstream_max_connections` (0: its default, no cap): a cap must stay above the most streams a load
    # opens, since the streams beyond it wait for a free connection, which an endless stream never frees
    upstream_max_connections: int = 0

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
        self.nginx_worker, self.nginx_master = workers[0], master.pid
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

    async def start_lifeguards(self, upstream_url: str, *, two_engines: bool = False) -> None:
        """The lifeguard under test; with `two_engines`, the same proxy of two engines on `upstream_url`; the
        baseline checkout's when there is one."""
        await self._start_lifeguard(["--upstream", upstream_url])
        self._add_path("lifeguard")
        if two_engines:
            config = self.workdir / "two-engines.yaml"
            config.write_text(
                "engines:\n"
                + "".join(
                    f"  - {{name: e{n}, upstream: '{upstream_url}', models: [{model}], gpus: [{n}]}}\n"
                    for n, model in enumerate(TWO_ENGINE_MODELS)
                )
            )
            self.lg_2e, self.lg_2e_port = await self._launch(["--config", str(config)], self.proxy_src, "2e")
            self._add_path("lifeguard-2e")
        if self.baseline_src is not None:
            self.lg_base, self.lg_base_port = await self._launch(
                ["--upstream", upstream_url], self.baseline_src, "base"
            )
            self._add_path("lifeguard-base")

    def _add_path(self, path: str) -> None:
        if path not in self.paths:
            self.paths.append(path)

    async def start_lifeguard_engines(self, config: Path) -> Proc:
        """The proxy of several engines (`engines:` in `config`); ready once it has seen every engine."""
        return await self._start_lifeguard(["--config", str(config)])

    async def _start_lifeguard(self, target: list[str]) -> Proc:
        await self.stop_lifeguard()
        self.lg, self.lg_port = await self._launch(target, self.proxy_src, "")
        return self.lg

    async def launch(
        self, target: list[str], suffix: str, flags: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> tuple[Proc, int]:
        """A lifeguard of this checkout beside the others, named `lifeguard-<suffix>` (`stop_named` ends it);
        `flags` after the rig's own (a later `--log-level` wins), `env` added to its environment."""
        return await self._launch(target, self.proxy_src, suffix, flags, env)

    async def _launch(
        self,
        target: list[str],
        src: Path,
        suffix: str,
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> tuple[Proc, int]:
        port = free_port()
        argv = [sys.executable, "-m", "proxy", "serve", *target]
        argv += ["--port", str(port), "--gpu-probe", "none", "--no-canary", "--log-level", "warning", *flags]
        if self.upstream_max_connections:
            env = {"LIFEGUARD_UPSTREAM_MAX_CONNECTIONS": str(self.upstream_max_connections), **(env or {})}
        proc = self.start("lifeguard" + (f"-{suffix}" if suffix else ""), argv, cwd=src, env=env)

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
        for proc in (self.lg, self.lg_2e, self.lg_base):
            if proc is not None:
                proc.stop()
                self.procs.remove(proc)
        self.lg = self.lg_2e = self.lg_base = None
        self.paths = [path for path in self.paths if path not in ("lifeguard-2e", "lifeguard-base")]

    def stop_named(self, name: str) -> None:
        for proc in [p for p in self.procs if p.name == name]:
            proc.stop()
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    @property
    def lg_pid(self) -> int | None:
        return self.lg.pid if self.lg is not None else None

    @property
    def lg_2e_pid(self) -> int | None:
        return self.lg_2e.pid if self.lg_2e is not None else None

    @property
    def lg_base_pid(self) -> int | None:
        return self.lg_base.pid if self.lg_base is not None else None

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
