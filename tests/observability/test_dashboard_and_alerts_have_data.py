"""A real Prometheus scrapes the proxy in front of the simulator; every panel and alert has data.

Run by `make test-observability` (scripts/check-observability.sh), which installs Debian's
`prometheus` first. Processes: the simulator, `vllm-lifeguard serve` in front of it, and Prometheus
(scrape and rule evaluation every 1 s) with two jobs that carry the static labels `namespace` and
`pod`, as a Kubernetes scrape would: `lifeguard` (the proxy's /lifeguard/metrics) and `vllm` (vLLM's
/metrics, read through the proxy's unchanged passthrough). The lifeguard rules are loaded too.

A second proxy, of two engines (`engines:`, two simulators sharing one simulated GPU that holds one of them
awake), is scraped by the `lifeguard` job as pod `swap-0`: requests for each model in turn swap them, so
the swap panels have data; the single-engine pod's series carry `engine="default"`.

The scenario: inference; an invalid sleep; sleep; a refused resume; requests held; a wake that fails (sim fault
`wake_up:error500`) while they stay held; they reach their hold deadline; a client that gives up;
a good wake that releases a held request; a wake that lies (`wake_up:lie-asleep`); drift (a pause
sent to vLLM directly); the engine killed (FAILED) and started again.

Then every target of every dashboard panel is run as Grafana would run it for a dashboard showing
the scenario's time span: `/api/v1/query_range` from the scenario's start to now, step 1 s, with
  * `$namespace`, `$pod`    -> this test's namespace and its two pods (a two-value selection),
  * `$engine`               -> `.*`, the variable's All value,
  * `$__rate_interval`      -> 4s: Grafana's max($__interval + scrape interval, 4 x scrape interval)
                               with a 1 s step and a 1 s scrape interval.
A target "has data" when at least one returned sample is a number (NaN, e.g. a quantile of an
empty histogram, is no data). Each alert's expression is run the same way after removing its
threshold (a trailing `> N`/`== N`, applied to each side of `and`), and the alerts the scenario
provokes must show up in Prometheus's own ALERTS series (pending or firing).

Every wait polls against a deadline; every process is killed by its own id at the end.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "lifeguard-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "lifeguard-rules.yaml"
CLI = Path(sys.executable).parent / "vllm-lifeguard"
NAMESPACE, POD, SWAP_POD = "obs-test", "gen-0", "swap-0"
HOLD_TIMEOUT_S = 6.0  # long enough for the steps between holding and the deadline on a slow box
# Alerts the scenario provokes; each must appear in ALERTS (pending or firing).
PROVOKED = ("LifeguardLieCaught", "LifeguardHoldTimeouts", "LifeguardDrift", "LifeguardEngineFailed")


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Processes:
    logs: Path
    started: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            self.started[name] = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: we stop exactly what we started
            )

    def kill(self, name: str) -> None:
        proc = self.started.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in list(self.started.items()):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            del self.started[name]

    def tails(self) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-25:]
            out.append(f"--- {path.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(out)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], procs: Processes, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except (aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError) as exc:
            last_error = exc
        for name, proc in procs.started.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}\n{procs.tails()}")
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_error!r})\n{procs.tails()}")


# --- the PromQL under test ------------------------------------------------------------------


def panel_targets() -> list[tuple[str, str]]:
    """(label, expr) for every target of every panel, rows' nested panels included."""
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((f"panel {panel['title']!r} [{target['refId']}]", target["expr"]))

    walk(dashboard["panels"])
    return found


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "4s")
    expr = expr.replace("$namespace", NAMESPACE).replace("$pod", f"{POD}|{SWAP_POD}").replace("$engine", ".*")
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


_THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[-+]?\d+(\.\d+)?\s*$")


def alert_cores() -> list[tuple[str, str]]:
    """(label, expr) for each alert expression with its thresholds removed, per side of `and`."""
    rules = yaml.safe_load(RULES.read_text())
    cores = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            parts = re.split(r"\s+and\s+on\s*\([^)]*\)\s+", rule["expr"].strip())
            for i, part in enumerate(parts):
                core = _THRESHOLD.sub("", part)
                assert core != part, f"{rule['alert']}: no threshold found to strip in {part!r}"
                cores.append((f"alert {rule['alert']} [{i}]", core))
    return cores


def alert_names() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"]]


# --- the test -------------------------------------------------------------------------------


class Api:
    def __init__(self, session: aiohttp.ClientSession, proxy: str, sim: str, prom: str) -> None:
        self.s, self.proxy, self.sim, self.prom = session, proxy, sim, prom

    async def state(self) -> dict[str, Any]:
        async with self.s.get(f"{self.proxy}/lifeguard/state") as resp:
            body: dict[str, Any] = await resp.json()
            return body

    async def in_state(self, *names: str) -> bool:
        return (await self.state())["state"] in names

    async def post(self, path: str, base: str | None = None, **kwargs: Any) -> tuple[int, str]:
        async with self.s.post(f"{base or self.proxy}{path}", **kwargs) as resp:
            return resp.status, await resp.text()

    async def faults(self, specs: list[str]) -> None:
        status, text = await self.post("/sim/faults", base=self.sim, json=specs)
        assert status == 200, text

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with self.s.get(f"{self.prom}/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def query_range(self, expr: str, start: float, end: float) -> dict[str, Any]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
        async with self.s.get(f"{self.prom}/api/v1/query_range", params=params) as resp:
            body: dict[str, Any] = await resp.json()
            return body

    async def prom_value(self, expr: str) -> float | None:
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else None


def completion(model: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "stream": stream}


async def test_every_panel_and_alert_query_has_data(procs: Processes, tmp_path: Path) -> None:
    sim_port, proxy_port, prom_port = free_port(), free_port(), free_port()
    gpu_file = tmp_path / "gpu.json"
    sim_argv = [
        str(CLI), "sim", "--port", str(sim_port), "--gpu-file", str(gpu_file),
        "--sleep-seconds", "0.2", "--wake-seconds", "0.3", "--token-seconds", "0.005",
        "--watchdog-seconds", "1",
    ]  # fmt: skip
    procs.start("sim", sim_argv)
    procs.start(
        "proxy",
        [
            str(CLI),
            "serve",
            "--upstream",
            f"http://127.0.0.1:{sim_port}",
            "--port",
            str(proxy_port),
            "--gpu-probe",
            f"file:{gpu_file}",
        ],  # fmt: skip
        env={
            "LIFEGUARD_HOLD_TIMEOUT_S": str(HOLD_TIMEOUT_S),
            "LIFEGUARD_RECONCILE_INTERVAL_S": "0.5",
            "LIFEGUARD_VERIFY_TIMEOUT_S": "2",  # the lying wake is caught when this runs out
        },
    )
    swap_proxy = await _start_two_engines(procs, tmp_path)
    target = f"127.0.0.1:{proxy_port}"
    labels = {"namespace": NAMESPACE, "pod": POD}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "lifeguard",
                "metrics_path": "/lifeguard/metrics",
                "static_configs": [
                    {"targets": [target], "labels": labels},
                    {"targets": [swap_proxy.removeprefix("http://")], "labels": {**labels, "pod": SWAP_POD}},
                ],
            },
            {
                "job_name": "vllm",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [target], "labels": labels}],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    procs.start(
        "prometheus",
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],  # fmt: skip
    )

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        api = Api(session, f"http://{target}", f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{prom_port}")

        async def ready(url: str) -> bool:
            async with session.get(url) as resp:
                return resp.status == 200

        await wait_for("Prometheus ready", lambda: ready(f"{api.prom}/-/ready"), procs)
        await wait_for("proxy RUNNING", lambda: api.in_state("RUNNING"), procs, timeout=30)
        await wait_for(
            "both scrape jobs up",
            lambda: _all_up(api),
            procs,
        )
        start = time.time() - 5

        # two engines on one GPU: each model in turn swaps it in
        for model_name in ("model-b", "model-a"):
            status, text = await api.post("/v1/completions", base=swap_proxy, json=completion(model_name))
            assert status == 200, text

        # inference, streamed and not
        async with session.get(f"{api.proxy}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        for _ in range(3):
            status, text = await api.post("/v1/completions", json=completion(model))
            assert status == 200, text
        status, text = await api.post("/v1/completions", json=completion(model, 8, stream=True))
        assert status == 200 and "[DONE]" in text, text

        # a lifecycle call turned away before reaching vLLM
        status, text = await api.post("/sleep", params={"level": "7"})
        assert status == 400, text

        # sleep; requests arrive and are held
        status, text = await api.post("/sleep", params={"level": "1"})
        assert status == 200, text
        assert await api.in_state("SLEEPING")
        status, text = await api.post("/resume")  # refused: vLLM would schedule on freed memory
        assert status == 409, text
        held = [asyncio.ensure_future(api.post("/v1/completions", json=completion(model))) for _ in range(2)]
        await wait_for("2 requests held", lambda: _held(api, 2), procs)
        await wait_for(
            "Prometheus to see the held requests",
            lambda: _prom_at_least(api, f'lifeguard_held_requests{{pod="{POD}"}}', 2),
            procs,
        )

        # a wake that fails upstream: 503, back to SLEEPING, the requests stay held
        await api.faults(["wake_up:error500"])
        status, text = await api.post("/wake_up")
        assert status == 503, text
        await wait_for("SLEEPING after the failed wake", lambda: api.in_state("SLEEPING"), procs)
        assert (await api.state())["held_requests"] == 2

        # a client that gives up while held
        gone = asyncio.ensure_future(api.post("/v1/completions", json=completion(model)))
        await wait_for("3 requests held", lambda: _held(api, 3), procs)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)

        # the first two reach their hold deadline: 503 hold_timeout
        results = await asyncio.wait_for(asyncio.gather(*held), timeout=HOLD_TIMEOUT_S + 10)
        assert [status for status, _ in results] == [503, 503], results

        # a good wake releases a held request
        late = asyncio.ensure_future(api.post("/v1/completions", json=completion(model)))
        await wait_for("1 request held", lambda: _held(api, 1), procs)
        await api.faults([])
        status, text = await api.post("/wake_up")
        assert status == 200, text
        status, text = await asyncio.wait_for(late, timeout=20)
        assert status == 200, text

        # a wake that vLLM answers 200 but does not do: caught, 503
        status, text = await api.post("/sleep", params={"level": "1"})
        assert status == 200, text
        await api.faults(["wake_up:lie-asleep"])
        status, text = await api.post("/wake_up")
        assert status == 503, f"a lying wake_up was answered {status}: {text}"
        await api.faults([])
        await wait_for("SLEEPING after the lie", lambda: api.in_state("SLEEPING"), procs)
        status, text = await api.post("/wake_up")
        assert status == 200, text

        # drift: vLLM paused behind the proxy's back; the proxy adopts it, then resumes through itself
        status, text = await api.post("/pause", base=api.sim)
        assert status == 200, text
        await wait_for("the proxy to adopt the drifted state", lambda: api.in_state("PAUSED"), procs)
        status, text = await api.post("/resume")
        assert status == 200, text
        assert await api.in_state("RUNNING")

        # the engine dies and comes back
        procs.kill("sim")
        await wait_for("FAILED once the engine is gone", lambda: api.in_state("FAILED"), procs)
        await wait_for(
            "Prometheus to see FAILED",
            lambda: _prom_at_least(api, f'lifeguard_state{{pod="{POD}",lifeguard_state="FAILED"}}', 1),
            procs,
        )
        procs.start("sim", sim_argv)
        await wait_for("RUNNING after the engine came back", lambda: api.in_state("RUNNING"), procs, timeout=30)
        status, text = await api.post("/v1/completions", json=completion(model))
        assert status == 200, text

        # let Prometheus scrape what happened last, and its rules see it
        end = time.time()
        await wait_for("a scrape after the scenario", lambda: _scraped_since(api, end + 1), procs)
        await wait_for("the provoked alerts", lambda: _alerts_seen(api, start), procs, timeout=15)
        end = time.time()

        # every panel target and every alert core must return data
        report, empty = [], []
        for label, expr in panel_targets() + alert_cores():
            body = await api.query_range(substitute(expr), start, end)
            assert body["status"] == "success", f"{label}: {body.get('error')}\n{expr}"
            series = body["data"]["result"]
            values = [float(v) for s in series for _, v in s["values"]]
            numbers = [v for v in values if not math.isnan(v)]
            latest = max(numbers) if numbers else None
            report.append(f"{'ok ' if numbers else 'NO DATA'} {label}: {len(series)} series, max {latest}")
            if not numbers:
                empty.append(f"{label}\n    {substitute(expr)}")
        fired = await _alerts_fired(api, start)
        report.append(f"alerts seen in ALERTS (pending or firing): {sorted(fired)}")
        print("\n".join(report))
        assert not empty, "queries with no data:\n" + "\n".join(empty)
        assert set(PROVOKED) <= fired, f"provoked alerts missing: {sorted(set(PROVOKED) - fired)}"
        assert fired <= set(alert_names())


async def _start_two_engines(procs: Processes, tmp_path: Path) -> str:
    """Two simulators sharing one GPU file (50 GiB each awake on an 80 GiB device: one fits at a time), `b`
    put to sleep, and a proxy of both with `engines:`; its URL once both engines are seen."""
    gpu_file = tmp_path / "swap-gpu.json"
    urls = {}
    for name in ("a", "b"):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        procs.start(
            f"sim-{name}",
            [
                str(CLI), "sim", "--port", str(port), "--model", f"model-{name}", "--gpu-file", str(gpu_file),
                "--gpu-file-engine", name, "--weights-gib", "16", "--kv-gib", "32", "--overhead-gib", "2",
                "--total-gib", "80", "--sleep-seconds", "0.2", "--wake-seconds", "0.3", "--token-seconds", "0.005",
            ],
        )  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def answers(url: str) -> bool:
            try:
                async with session.get(url) as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        for url in urls.values():
            await wait_for(f"simulator {url} up", lambda url=url: answers(f"{url}/health"), procs)
        async with session.post(f"{urls['b']}/sleep", params={"level": "1"}) as resp:
            assert resp.status == 200, await resp.text()
        config = tmp_path / "engines.yaml"
        engines = [{"name": name, "upstream": url, "gpus": [0]} for name, url in urls.items()]
        config.write_text(yaml.safe_dump({"engines": engines, "gpu_probe": f"file:{gpu_file}"}))
        port = free_port()
        procs.start("swap-proxy", [str(CLI), "serve", "--config", str(config), "--port", str(port)])
        proxy = f"http://127.0.0.1:{port}"

        async def both_seen() -> bool:
            if not await answers(f"{proxy}/lifeguard/state"):
                return False
            async with session.get(f"{proxy}/lifeguard/state") as resp:
                states = {e["state"] for e in (await resp.json())["engines"].values()}
            return states == {"RUNNING", "SLEEPING"}

        await wait_for("the two-engine proxy sees both engines", both_seen, procs, timeout=30)
    return proxy


async def _all_up(api: Api) -> bool:
    result = await api.query(f'up{{pod="{POD}"}} == 1')
    return {r["metric"]["job"] for r in result} == {"lifeguard", "vllm"}


async def _held(api: Api, count: int) -> bool:
    return int((await api.state())["held_requests"]) == count


async def _prom_at_least(api: Api, expr: str, value: float) -> bool:
    got = await api.prom_value(expr)
    return got is not None and got >= value


async def _scraped_since(api: Api, moment: float) -> bool:
    result = await api.query(f'timestamp(up{{pod="{POD}"}})')
    return len(result) == 2 and all(float(r["value"][1]) >= moment for r in result)


async def _alerts_fired(api: Api, start: float) -> set[str]:
    window = max(1, int(time.time() - start) + 1)
    result = await api.query(f'max_over_time(ALERTS{{pod="{POD}"}}[{window}s])')
    return {r["metric"]["alertname"] for r in result}


async def _alerts_seen(api: Api, start: float) -> bool:
    return set(PROVOKED) <= await _alerts_fired(api, start)
