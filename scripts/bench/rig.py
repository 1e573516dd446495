"""The rig: the three paths the same load goes through, and the processes behind them.

* direct: to the trivial upstream (nginx, fixed answers) or, for SSE and lifecycle, to the fake vLLM
  (`upstream.py`);
* nginx: nginx as a reverse proxy in front of both (one worker: one proxy process against one);
* lifeguard: `python -m proxy serve` from the checkout under test, one process, on the data plane
  `--data-plane` names (raw, the default, or aiohttp).
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


PATHS = {
    "direct": LoadPath(port="up_port", sse_port="sse_port", measured=None),
    "nginx": LoadPath(port="nginx_port", sse_port="nginx_sse_port", measured="nginx_worker"),
    "lifeguard": LoadPath(port="lg_port", sse_port="lg_port", measured="lg_pid"),
}


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

    async def start_lifeguard(self, upstream_port: int) -> Proc:
        return await self._start_lifeguard(["--upstream", f"http://127.0.0.1:{upstream_port}"])

    async def start_lifeguard_engines(self, config: Path) -> Proc:
        """The proxy of several engines (`engines:` in `config`); ready once it has seen every engine."""
        return await self._start_lifeguard(["--config", str(config)])

    async def _start_lifeguard(self, target: list[str]) -> Proc:
        await self.stop_lifeguard()
        self.lg_port = free_port()
        argv = [sys.executable, "-m", "proxy", "serve", *target]
        argv += ["--port", str(self.lg_port), "--gpu-probe", "none", "--no-canary", "--log-level", "warning"]
        argv += ["--data-plane", self.data_plane]
        self.lg = self.start("lifeguard", argv, cwd=self.proxy_src)

        async def running() -> bool:
            status, body = await http(self.lg_port, "GET", "/lifeguard/state", timeout=2)
            if status != 200:
                return False
            state = json.loads(body)
            if "engines" in state:
                return all(e["state"] in ("RUNNING", "SLEEPING") for e in state["engines"].values())
            return bool(state["state"] == "RUNNING")

        try:
            await wait_until(running, "vllm-lifeguard to reach RUNNING")
        except RuntimeError:
            log(self.lg.tail())
            raise
        return self.lg

    async def stop_lifeguard(self) -> None:
        if self.lg is not None:
            self.lg.stop()
            self.procs.remove(self.lg)
            self.lg = None

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    @property
    def lg_pid(self) -> int | None:
        return self.lg.pid if self.lg is not None else None

    def port(self, path: str, *, sse: bool = False) -> int:
        row = PATHS[path]
        return int(getattr(self, row.sse_port if sse else row.port))

    def proxy_pid(self, path: str) -> int | None:
        """The process whose CPU and memory a run on `path` measures (none for direct)."""
        measured = PATHS[path].measured
        if measured is None:
            return None
        pid = getattr(self, measured)
        return int(pid) if pid else None


async def _healthy(port: int) -> bool:
    status, _ = await http(port, "GET", "/health")
    return status == 200
