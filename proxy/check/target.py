"""What is at a URL: a vLLM, or a lifeguard and the vLLM behind it; read-only, a handful of GETs.

Every fact the report shows about a deployment comes from here: the version and the lifeguard profile it
matches, dev mode and sleep mode, the routes it serves classified against the lifeguard's route table, the
admin token, `/lifeguard/serving` against the state, NVML on this machine, and whether the engine is idle.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..front.route_table import build_table
from ..gpu.readers import make_reader
from .client import CALL_TIMEOUT_S, Http, Reply

#: The vLLM releases the lifeguard models (the simulator's profiles).
PROFILES = ("0.32", "0.33")
#: Reads of the target are quick or they are a finding.
READ_TIMEOUT_S = 10.0


class CheckError(Exception):
    """The target could not be checked; the message is one sentence that says why and what to do."""


@dataclass
class Target:
    url: str
    kind: str  # "vllm" or "lifeguard"
    vllm_version: str
    profile: str | None  # "0.32"/"0.33" when the lifeguard models this release, else None
    model: str
    dev_mode: bool
    sleep_mode: bool | None  # None: /server_info did not say
    lora_adapters: list[str] = field(default_factory=list)
    routes: dict[str, list[str]] = field(default_factory=dict)  # route kind -> "METHOD /path"
    upstream: str | None = None  # a lifeguard's vLLM, as its state names it
    upstream_reachable: bool | None = None
    token_enforced: bool | None = None  # a lifeguard only
    serving: dict[str, Any] | None = None  # a lifeguard only: /lifeguard/serving against the state
    lifeguard_state: str | None = None
    gpu: dict[str, Any] = field(default_factory=dict)
    busy: str | None = None  # why the engine is not idle, or None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def inspect(http: Http, *, gpu_probe: str = "nvml") -> Target:
    """Read what is at ``http``'s URL, or raise `CheckError` saying why it cannot be checked."""
    version = await http.get("/version", timeout=READ_TIMEOUT_S, token=False)
    if version.status is None:
        raise CheckError(f"cannot reach {http.base}: {version.failure}.")
    if version.status != 200 or not isinstance(version.body, dict) or "version" not in version.body:
        raise CheckError(
            f"{http.base} is not a vLLM: GET /version answered {version.summary()[:80]!r}, not vLLM's version."
        )
    state = await _lifeguard_state(http)
    kind = "vllm" if state is None else "lifeguard"
    vllm_version = str(version.body["version"])
    dev_mode = await _dev_mode(http)
    target = Target(
        url=http.base,
        kind=kind,
        vllm_version=vllm_version,
        profile=profile_of(vllm_version),
        model=await _model(http),
        dev_mode=dev_mode,
        sleep_mode=await _sleep_mode(http),
        lora_adapters=await adapters(http),
        routes=await _routes(http),
        gpu=await _gpu(gpu_probe),
    )
    if state is not None:
        await _read_lifeguard(http, state, target)
    target.busy = await busy(http, target.kind)
    return target


async def _dev_mode(http: Http) -> bool:
    """Whether vLLM serves its lifecycle routes: `/is_sleeping` answers, or is not found (404). Anything else (an
    error, no answer) says nothing about dev mode, and is what stops the check."""
    # vLLM answers /is_sleeping from its engine core, between two steps: behind a cold vLLM-for-CPU's first forward
    # pass (the canary a lifeguard records as it starts) it took 3.4 s on a busy 2-core machine, where the other reads
    # took 5 ms; read with the 10 s of the others, a CI run's check once called that vLLM "not in dev mode".
    sleeping = await http.get("/is_sleeping", timeout=CALL_TIMEOUT_S)
    if sleeping.status in (200, 404):
        return sleeping.status == 200
    said = f": {sleeping.failure}" if sleeping.status is None else f" answered {sleeping.summary()[:120]}"
    raise CheckError(
        f"{http.base} cannot be checked now: GET /is_sleeping{said}; run the check again once the engine answers."
    )


def profile_of(version: str) -> str | None:
    major_minor = ".".join(version.split(".")[:2])
    return major_minor if major_minor in PROFILES else None


async def _lifeguard_state(http: Http) -> dict[str, Any] | None:
    reply = await http.get("/lifeguard/state", timeout=READ_TIMEOUT_S)
    if reply.status == 401:
        raise CheckError(
            f"{http.base} is a lifeguard with an admin token and none was given (401): pass --token-file FILE "
            "or set LIFEGUARD_ADMIN_TOKEN."
        )
    if reply.status == 403:
        raise CheckError(f"{http.base} is a lifeguard that refused the admin token given (403): it is not its token.")
    if reply.status != 200 or not isinstance(reply.body, dict) or "state" not in reply.body:
        return None
    engines = reply.body.get("engines")
    if isinstance(engines, dict) and len(engines) > 1:
        names = ", ".join(sorted(engines))
        raise CheckError(
            f"{http.base} guards {len(engines)} engines ({names}); check one at a time: {http.base}/engines/NAME."
        )
    state: dict[str, Any] = reply.body
    return state


async def _read_lifeguard(http: Http, state: dict[str, Any], target: Target) -> None:
    target.lifeguard_state = str(state.get("state"))
    upstream = state.get("upstream")
    target.upstream = str(upstream) if upstream else None
    if target.upstream:
        behind = await Http(http.session, target.upstream).get("/version", timeout=5.0, token=False)
        target.upstream_reachable = behind.status == 200
    anonymous = await http.get("/lifeguard/state", timeout=READ_TIMEOUT_S, token=False)
    target.token_enforced = anonymous.status == 401
    serving = await http.get("/lifeguard/serving", timeout=READ_TIMEOUT_S)
    target.serving = serving_agreement(target.lifeguard_state, serving)


def serving_agreement(state: str, serving: Reply) -> dict[str, Any]:
    """`/lifeguard/serving` must be 200 only in RUNNING, and say why not (a cause) whenever it is 503."""
    cause = None
    if serving.status != 200 and isinstance(serving.body, dict):
        cause = (serving.body.get("error") or {}).get("cause")
    if serving.status == 200:
        agrees = state == "RUNNING"
    else:
        agrees = serving.status == 503 and cause is not None
    return {"state": state, "status": serving.status, "cause": cause, "agrees": agrees}


async def _model(http: Http) -> str:
    models = await http.get("/v1/models", timeout=READ_TIMEOUT_S)
    for entry in _model_entries(models):
        if not entry.get("parent"):
            return str(entry.get("id"))
    raise CheckError(f"{http.base} serves no model: GET /v1/models answered {models.summary()[:80]!r}.")


async def adapters(http: Http) -> list[str]:
    models = await http.get("/v1/models", timeout=READ_TIMEOUT_S)
    return [str(entry.get("id")) for entry in _model_entries(models) if entry.get("parent")]


def _model_entries(reply: Reply) -> list[dict[str, Any]]:
    data = reply.body.get("data") if isinstance(reply.body, dict) else None
    return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []


async def _sleep_mode(http: Http) -> bool | None:
    """vLLM's ``enable_sleep_mode``: from /server_info's JSON config (vLLM), else its text form."""
    info = await http.get("/server_info?config_format=json", timeout=READ_TIMEOUT_S)
    config = info.body.get("vllm_config") if isinstance(info.body, dict) else None
    if isinstance(config, dict):  # vLLM 0.32 keeps it in model_config (the simulator in cache_config)
        for section in ("model_config", "cache_config"):
            enabled = (config.get(section) or {}).get("enable_sleep_mode")
            if isinstance(enabled, bool):
                return enabled
        return None
    match = re.search(r"enable_sleep_mode=(True|False)", str(config))
    return None if match is None else match.group(1) == "True"


async def _routes(http: Http) -> dict[str, list[str]]:
    """vLLM's own routes (its /openapi.json) by the kind the lifeguard's table gives them; ``unclassified``
    are the ones the table has no entry for."""
    spec = await http.get("/openapi.json", timeout=READ_TIMEOUT_S)
    paths = spec.body.get("paths") if isinstance(spec.body, dict) else None
    if not isinstance(paths, dict):
        return {}
    table = build_table()
    kinds: dict[str, list[str]] = {}
    for path, operations in sorted(paths.items()):
        for method in sorted(m.upper() for m in operations if m.upper() in ("GET", "POST", "PUT", "DELETE")):
            route = table.lookup(method, path)
            kinds.setdefault(route.kind.value if route else "unclassified", []).append(f"{method} {path}")
    return kinds


async def _gpu(probe: str) -> dict[str, Any]:
    """The GPU memory the physical rows will read (``probe``: nvml, file:PATH or none), on this machine."""
    if probe == "none":
        return {"available": False, "reason": None}
    reading = await make_reader(probe).read()
    if not reading.available:
        return {"available": False, "reason": reading.unavailable}
    return {"available": True, "used_bytes": reading.used_bytes, "total_bytes": reading.total_bytes}


async def busy(http: Http, kind: str) -> str | None:
    """Why the engine is not idle (requests running, waiting, held or in flight), or None when it is."""
    if kind == "lifeguard":
        state = await http.get("/lifeguard/state", timeout=READ_TIMEOUT_S)
        body = state.body if isinstance(state.body, dict) else {}
        held, inflight = int(body.get("held_requests") or 0), int(body.get("inflight_requests") or 0)
        if held or inflight:
            return f"the lifeguard holds {held} and has {inflight} in flight"
        if body.get("state") != "RUNNING":
            return f"the lifeguard's engine is {body.get('state')}, not RUNNING"
    metrics = await http.get("/metrics", timeout=READ_TIMEOUT_S)
    running = metric_sum(metrics.text, "vllm:num_requests_running")
    waiting = metric_sum(metrics.text, "vllm:num_requests_waiting")
    if running or waiting:
        return f"vLLM has {running:g} requests running and {waiting:g} waiting"
    return None


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
