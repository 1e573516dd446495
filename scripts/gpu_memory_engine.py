"""A small "memory engine" for `scripts/gpu-check.sh`, and the check that drives the proxy in front of it.

`serve` answers vLLM's lifecycle routes (/health, /is_sleeping, /is_paused, /sleep?level&mode,
/wake_up?tags, /pause, /resume, /collective_rpc reload_weights, /v1/models, /v1/completions) and really
moves GPU memory with torch: a weights tensor and a KV pool of a few GiB each. Level 1 copies the weights
to CPU and frees both; level 2 discards both (the weights are garbage until reload_weights); a wake by
tag maps them again. It can lie, the way vLLM's 200s do (vllm-lifecycle-api.md §5): `--lie sleep` (or
`POST /engine/lie?op=sleep`, once) answers /sleep 200 and flips the flags without freeing anything;
`--lie wake` answers /wake_up 200, flags awake, without restoring the memory.

Without CUDA (no torch, or no GPU) `serve --pretend --gpu-file PATH` keeps the same books without
allocating and writes the simulator's memory file, which the proxy reads with `--gpu-probe file:PATH`.

`check` runs the steps through the proxy (honest sleep and wake at levels 1 and 2, a lying sleep, a
lying wake), reads what the proxy verified (`X-Lifeguard-Verified`, `/lifeguard/state`) and what the
engine's own device reports, and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import ClientSession, ClientTimeout, web

GIB = 1 << 30
TAGS = ("weights", "kv_cache")
_BLOCK = 1 << 20  # the weights pattern repeats every MiB; sizes are whole MiB
GOOD_ANSWER = (" Paris", -0.1054)
GARBLED_ANSWER = (" the", -7.3125)


# ----- where the bytes live
class Backend(Protocol):
    name: str

    def free(self, tag: str, *, keep_copy: bool) -> None: ...
    def restore(self, tag: str) -> None: ...
    def reload_weights(self) -> None: ...
    def weights_intact(self) -> bool: ...
    def resident(self) -> set[str]: ...
    def device_used_bytes(self) -> int: ...
    def describe(self) -> dict[str, Any]: ...


class PretendBackend:
    """No GPU: the same books, and the simulator's `--gpu-file` for the proxy's `file:` probe."""

    name = "pretend"

    def __init__(self, sizes: dict[str, int], gpu_file: Path | None, *, overhead: int = GIB, total: int = 80 * GIB):
        self._sizes = sizes
        self._gpu_file = gpu_file
        self._overhead = overhead
        self._total = total
        self._resident = set(TAGS)
        self._intact = True  # the weights' bytes as they are now (a fresh mapping is not the model)
        self._cpu_copy = False
        self._publish()

    def free(self, tag: str, *, keep_copy: bool) -> None:
        if tag in self._resident:
            self._resident.discard(tag)
            if tag == "weights":
                self._cpu_copy = keep_copy and self._intact
        self._publish()

    def restore(self, tag: str) -> None:
        if tag not in self._resident:
            self._resident.add(tag)
            if tag == "weights":
                self._intact, self._cpu_copy = self._cpu_copy, False
        self._publish()

    def reload_weights(self) -> None:
        self._intact = True

    def weights_intact(self) -> bool:
        return "weights" in self._resident and self._intact

    def resident(self) -> set[str]:
        return set(self._resident)

    def device_used_bytes(self) -> int:
        return self._overhead + sum(self._sizes[t] for t in self._resident)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": "none (pretend)", "total_bytes": self._total}

    def _publish(self) -> None:
        if self._gpu_file is None:
            return
        used = self.device_used_bytes()
        snapshot = {
            "used_bytes": used,
            "total_bytes": self._total,
            "devices": [{"index": 0, "uuid": "GPU-pretend-0", "used_bytes": used, "total_bytes": self._total}],
        }
        fd, tmp = tempfile.mkstemp(prefix=".gpu.", dir=self._gpu_file.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(snapshot, out)
        os.replace(tmp, self._gpu_file)


class TorchBackend:
    """Real CUDA memory: uint8 tensors, freed with `empty_cache()` so NVML sees the bytes go."""

    name = "torch"

    def __init__(self, sizes: dict[str, int], device: str = "cuda:0") -> None:
        import torch  # only here: the CPU path never needs it

        self._torch = torch
        self._device = torch.device(device)
        self._sizes = sizes
        self._pattern = (torch.arange(_BLOCK, device=self._device) % 251).to(torch.uint8)
        self._gpu: dict[str, Any] = {}
        self._cpu: dict[str, Any] = {}
        for tag in TAGS:
            self._gpu[tag] = self._alloc(tag)
        self.reload_weights()
        self._gpu["kv_cache"].zero_()
        torch.cuda.synchronize(self._device)

    def _alloc(self, tag: str) -> Any:
        return self._torch.empty(self._sizes[tag], dtype=self._torch.uint8, device=self._device)

    def free(self, tag: str, *, keep_copy: bool) -> None:
        tensor = self._gpu.pop(tag, None)
        if tensor is None:
            return
        if keep_copy:
            self._cpu[tag] = tensor.to("cpu")
        del tensor
        self._torch.cuda.synchronize(self._device)
        self._torch.cuda.empty_cache()

    def restore(self, tag: str) -> None:
        if tag in self._gpu:
            return
        tensor = self._alloc(tag)
        backup = self._cpu.pop(tag, None)
        if backup is not None:
            tensor.copy_(backup)
        elif tag == "kv_cache":
            tensor.zero_()
        # discarded weights come back as whatever the fresh pages hold (CUDA does not zero them)
        self._gpu[tag] = tensor
        self._torch.cuda.synchronize(self._device)

    def reload_weights(self) -> None:
        weights = self._gpu.get("weights")
        if weights is not None:
            weights.view(-1, _BLOCK).copy_(self._pattern)

    def weights_intact(self) -> bool:
        weights = self._gpu.get("weights")
        return weights is not None and bool(self._torch.equal(weights[-_BLOCK:], self._pattern))

    def resident(self) -> set[str]:
        return set(self._gpu)

    def device_used_bytes(self) -> int:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return int(total - free)

    def describe(self) -> dict[str, Any]:
        props = self._torch.cuda.get_device_properties(self._device)
        return {"backend": self.name, "device": props.name, "total_bytes": int(props.total_memory)}


# ----- the engine's books: vLLM's flags and tags, and the lies
@dataclass
class MemoryEngine:
    backend: Backend
    lies: set[str] = field(default_factory=set)  # persistent: "sleep", "wake"
    once: set[str] = field(default_factory=set)  # armed for the next call only
    asleep_tags: set[str] = field(default_factory=set)
    paused: bool = False
    sleep_level: int | None = None
    weights_valid: bool = True
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def is_sleeping(self) -> bool:
        return self.paused or bool(self.asleep_tags)

    def _lying(self, op: str) -> bool:
        self.counters[op] = self.counters.get(op, 0) + 1
        if op in self.once:
            self.once.discard(op)
            return True
        return op in self.lies

    def sleep(self, level: int) -> None:
        lie = self._lying("sleep")
        self.paused = True
        if self.asleep_tags or level == 0:  # vLLM: "Executor is already sleeping."; level 0 frees nothing
            self.sleep_level = self.sleep_level if self.asleep_tags else 0
            return
        self.asleep_tags = set(TAGS)
        self.sleep_level = level
        if lie:
            return
        self.backend.free("weights", keep_copy=level == 1)
        self.backend.free("kv_cache", keep_copy=False)
        if level >= 2:
            self.weights_valid = False

    def wake_up(self, tags: Iterable[str] | None) -> None:
        lie = self._lying("wake_up")
        wanted = set(TAGS) if tags is None else set(tags)
        to_wake = wanted & self.asleep_tags  # unknown or comma-joined tags: vLLM's silent no-op
        self.asleep_tags -= to_wake
        if not lie:
            for tag in sorted(to_wake):
                self.backend.restore(tag)
        if not self.asleep_tags:
            self.paused = False
            self.sleep_level = None

    def reload_weights(self) -> None:
        if "weights" in self.asleep_tags:
            raise web.HTTPInternalServerError(text="Call to collective_rpc method failed: weights are asleep")
        self.backend.reload_weights()
        self.weights_valid = True

    def answer(self) -> tuple[str, float]:
        return GOOD_ANSWER if self.weights_valid and self.backend.weights_intact() else GARBLED_ANSWER

    def state(self) -> dict[str, Any]:
        return {
            "is_sleeping": self.is_sleeping,
            "is_paused": self.paused,
            "asleep_tags": sorted(self.asleep_tags),
            "sleep_level": self.sleep_level,
            "weights_valid": self.weights_valid,
            "resident": sorted(self.backend.resident()),
            "device_used_bytes": self.backend.device_used_bytes(),
            "lies": sorted(self.lies),
            "armed": sorted(self.once),
            "counters": dict(self.counters),
            **self.backend.describe(),
        }


ENGINE = web.AppKey("engine", MemoryEngine)


def create_engine_app(engine: MemoryEngine, *, model: str = "memory-engine") -> web.Application:
    app = web.Application()
    app[ENGINE] = engine
    lock = asyncio.Lock()  # vLLM runs utility calls one at a time on the engine-core thread

    def ok(body: dict[str, Any] | None = None) -> web.Response:
        return web.json_response(body) if body is not None else web.Response(status=200)

    async def locked(work: Callable[[], None]) -> None:
        async with lock:
            await asyncio.to_thread(work)  # cudaMemcpy of GiBs blocks: keep /health answering

    async def sleep(request: web.Request) -> web.Response:
        level = int(request.query.get("level", "1"))
        await locked(lambda: engine.sleep(level))
        return ok()

    async def wake_up(request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        await locked(lambda: engine.wake_up(tags))
        return ok()

    async def pause(request: web.Request) -> web.Response:
        engine.paused = True
        return ok({"status": "paused"})

    async def resume(request: web.Request) -> web.Response:
        engine.paused = False  # like vLLM, also while asleep (the proxy must never send this then)
        return ok({"status": "resumed"})

    async def collective_rpc(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("method") != "reload_weights":
            raise web.HTTPBadRequest(text=f"unsupported method {body.get('method')!r}")
        await locked(engine.reload_weights)
        return ok()

    async def models(request: web.Request) -> web.Response:
        return ok({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]})

    async def completions(request: web.Request) -> web.Response:
        if engine.is_sleeping:
            raise web.HTTPServiceUnavailable(text="the memory engine is asleep; the proxy should have held this")
        text, logprob = engine.answer()
        choice = {"index": 0, "text": text, "logprobs": {"token_logprobs": [logprob]}, "finish_reason": "length"}
        return ok({"object": "text_completion", "model": model, "choices": [choice]})

    async def lie(request: web.Request) -> web.Response:
        op = request.query.get("op", "")
        if op not in ("sleep", "wake"):
            raise web.HTTPBadRequest(text="op must be sleep or wake")
        engine.once.add("wake_up" if op == "wake" else "sleep")
        return ok({"armed": sorted(engine.once)})

    async def state(request: web.Request) -> web.Response:
        return ok(engine.state())

    async def health(request: web.Request) -> web.Response:
        return ok()

    async def is_sleeping(request: web.Request) -> web.Response:
        return ok({"is_sleeping": engine.is_sleeping})

    async def is_paused(request: web.Request) -> web.Response:
        return ok({"is_paused": engine.paused})

    app.router.add_get("/health", health)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/engine/lie", lie)
    app.router.add_get("/engine/state", state)
    return app


def make_backend(*, pretend: bool, weights_gib: float, kv_gib: float, gpu_file: Path | None, device: str) -> Backend:
    sizes = {"weights": _mib_multiple(weights_gib), "kv_cache": _mib_multiple(kv_gib)}
    if pretend:
        return PretendBackend(sizes, gpu_file)
    return TorchBackend(sizes, device)


def cuda_available() -> tuple[bool, str]:
    """Whether torch can use a CUDA device here, and why not when it cannot."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, torch.cuda.get_device_name(0)


def _mib_multiple(gib: float) -> int:
    return max(1, round(gib * 1024)) * _BLOCK


# ----- the check: steps through the proxy, figures out
@dataclass(frozen=True)
class Step:
    name: str
    method: str
    path: str
    expect_status: int
    expect_state: str
    body: dict[str, Any] | None = None
    arm: str | None = None  # a one-shot lie to arm on the engine first
    expect_failed_check: str | None = None  # for a 503: which check must have caught it
    expect_memory: str | None = "pass"  # the memory check's result on a 200 that moves memory


STEPS: tuple[Step, ...] = (
    Step("honest sleep level 1", "POST", "/sleep?level=1", 200, "SLEEPING"),
    Step("honest wake", "POST", "/wake_up", 200, "RUNNING"),
    Step("honest sleep level 2", "POST", "/sleep?level=2", 200, "SLEEPING"),
    Step("wake the weights", "POST", "/wake_up?tags=weights", 200, "SLEEPING"),
    Step(
        "reload weights",
        "POST",
        "/collective_rpc",
        200,
        "SLEEPING",
        body={"method": "reload_weights"},
        expect_memory=None,
    ),
    Step("wake the kv cache", "POST", "/wake_up?tags=kv_cache", 200, "RUNNING"),
    Step("lying sleep", "POST", "/sleep?level=1", 503, "SLEEPING", arm="sleep", expect_failed_check="memory"),
    Step("honest wake after the lying sleep", "POST", "/wake_up", 200, "RUNNING"),
    Step("honest sleep before the lying wake", "POST", "/sleep?level=1", 200, "SLEEPING"),
    Step("lying wake", "POST", "/wake_up", 503, "FAILED", arm="wake", expect_failed_check="memory"),
)


def judge_step(step: Step, status: int, verified: str | None, state: dict[str, Any]) -> list[str]:
    """What is wrong with one step's outcome; empty when it went as the proxy promises."""
    problems = []
    if status != step.expect_status:
        problems.append(f"status {status}, expected {step.expect_status}")
    if state.get("state") != step.expect_state:
        problems.append(f"proxy state {state.get('state')}, expected {step.expect_state}")
    last = state.get("last_verification") or {}
    checks = {c["name"]: c["result"] for c in last.get("checks", [])}
    if step.expect_failed_check is not None:
        if checks.get(step.expect_failed_check) != "fail":
            problems.append(f"the {step.expect_failed_check} check did not fail: {checks}")
    elif step.expect_memory is not None and status == 200:
        memory = dict(part.split("=", 1) for part in (verified or "").split(",") if "=" in part).get("memory")
        if memory != step.expect_memory:
            problems.append(f"memory check {memory!r} in X-Lifeguard-Verified {verified!r}")
    return problems


async def run_check(proxy: str, engine: str, *, deadline_s: float = 120.0) -> dict[str, Any]:
    """Every step through the proxy, bounded by `deadline_s` in all; returns the report."""
    started = time.monotonic()
    report: dict[str, Any] = {"proxy": proxy, "engine": engine, "steps": [], "ok": False}
    async with ClientSession(timeout=ClientTimeout(total=60)) as http:

        async def get(url: str) -> dict[str, Any]:
            async with http.get(url) as resp:
                body: dict[str, Any] = await resp.json()
                return body

        await _until(lambda: _state_is(get, proxy, "RUNNING"), started + 30, "the proxy to see the engine RUNNING")
        report["engine_info"] = await get(engine + "/engine/state")
        for step in STEPS:
            if time.monotonic() - started > deadline_s:
                report["error"] = f"out of time before step {step.name!r}"
                return report
            if step.arm:
                async with http.post(f"{engine}/engine/lie?op={step.arm}") as resp:
                    resp.raise_for_status()
            before = await get(engine + "/engine/state")
            previous = (await get(proxy + "/lifeguard/state")).get("last_verification") or {}
            t0 = time.monotonic()
            async with http.request(step.method, proxy + step.path, json=step.body) as resp:
                status = resp.status
                verified = resp.headers.get("X-Lifeguard-Verified")
                reason = resp.headers.get("X-Lifeguard-Reason")
                text = await resp.text()
            call_s = time.monotonic() - t0
            after = await get(engine + "/engine/state")
            state = await get(proxy + "/lifeguard/state")
            last = state.get("last_verification") or {}
            if last.get("at") == previous.get("at"):
                last = {}  # this call was not verified (collective_rpc): do not report the previous one
            problems = judge_step(step, status, verified, state)
            report["steps"].append(
                {
                    "step": step.name,
                    "call": f"{step.method} {step.path}",
                    "status": status,
                    "reason": reason,
                    "message": None if status == 200 else _message(text),
                    "verified": verified,
                    "proxy_state": state.get("state"),
                    "call_seconds": round(call_s, 4),
                    "verification_seconds": last.get("seconds"),
                    "verification_checks": last.get("checks"),
                    "proxy_gpu_memory_used_bytes": (state.get("gpu_memory") or {}).get("used_bytes"),
                    "device_used_bytes_before": before["device_used_bytes"],
                    "device_used_bytes_after": after["device_used_bytes"],
                    "engine_flags_after": {"is_sleeping": after["is_sleeping"], "is_paused": after["is_paused"]},
                    "resident_after": after["resident"],
                    "ok": not problems,
                    "problems": problems,
                }
            )
    report["seconds"] = round(time.monotonic() - started, 3)
    report["ok"] = all(s["ok"] for s in report["steps"]) and len(report["steps"]) == len(STEPS)
    return report


async def _state_is(get: Callable[[str], Awaitable[dict[str, Any]]], proxy: str, name: str) -> bool:
    try:
        return (await get(proxy + "/lifeguard/state")).get("state") == name
    except OSError:
        return False


async def _until(predicate: Callable[[], Awaitable[bool]], deadline: float, what: str) -> None:
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


# ----- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_memory_engine.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the memory engine")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--weights-gib", type=float, default=4.0)
    serve.add_argument("--kv-gib", type=float, default=4.0)
    serve.add_argument("--device", default="cuda:0")
    serve.add_argument("--lie", action="append", choices=["sleep", "wake"], default=[], help="lie on every call")
    serve.add_argument("--pretend", action="store_true", help="no CUDA: keep the books, allocate nothing")
    serve.add_argument("--gpu-file", type=Path, help="with --pretend: write the simulator's memory file here")
    check = sub.add_parser("check", help="drive the proxy through the steps and write the figures")
    check.add_argument("--proxy", required=True)
    check.add_argument("--engine", required=True)
    check.add_argument("--out", type=Path, required=True)
    check.add_argument("--deadline-s", type=float, default=120.0)
    check.add_argument("--extra", default="{}", help="JSON merged into the report (mode, probe, ...)")
    sub.add_parser("cuda", help="print whether CUDA is usable here (exit 0) or why not (exit 1)")
    args = parser.parse_args(argv)

    if args.command == "cuda":
        usable, why = cuda_available()
        print(why)
        return 0 if usable else 1
    if args.command == "serve":
        backend = make_backend(
            pretend=args.pretend,
            weights_gib=args.weights_gib,
            kv_gib=args.kv_gib,
            gpu_file=args.gpu_file,
            device=args.device,
        )
        lies = {"wake_up" if lie == "wake" else "sleep" for lie in args.lie}
        engine = MemoryEngine(backend, lies=lies)
        web.run_app(create_engine_app(engine), host=args.host, port=args.port, print=None)
        return 0
    try:
        report = asyncio.run(run_check(args.proxy, args.engine, deadline_s=args.deadline_s))
    except (TimeoutError, OSError) as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "steps": []}
    report.update(json.loads(args.extra))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for step in report["steps"]:
        mark = "ok  " if step["ok"] else "FAIL"
        print(
            f"{mark} {step['step']:<36} {step['status']} {step['proxy_state']:<9} "
            f"device {step['device_used_bytes_before'] / GIB:6.2f} -> {step['device_used_bytes_after'] / GIB:6.2f} GiB"
            f"  verify {step['verification_seconds']} s  {'; '.join(step['problems'])}"
        )
    if report.get("error"):
        print(f"error: {report['error']}", file=sys.stderr)
    print(f"{'PASS' if report['ok'] else 'FAIL'}: figures in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
