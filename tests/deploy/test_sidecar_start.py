"""The native sidecar starts before vLLM (Kubernetes starts initContainers first): the probes the
manifests use must behave through that window."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lifeguard_sim.app import SimSettings, create_sim_app
from proxy.config import Settings
from tests.lifeguard_testing import without_lifeguard_env


@pytest.fixture(autouse=True)
def _no_lifeguard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    without_lifeguard_env(monkeypatch)


async def test_liveness_passes_before_vllm_exists_and_readiness_follows_vllm(
    serve_lifeguard: Any, aiohttp_server: Any, unused_tcp_port: int
) -> None:
    port = unused_tcp_port
    settings = Settings(
        upstream=f"http://127.0.0.1:{port}", gpu_probe="none", canary_enabled=False, reconcile_interval_s=0.1
    )
    proxy = await serve_lifeguard(settings)

    # startupProbe and livenessProbe: the proxy's own loop, so the kubelet moves on to start vLLM.
    assert (await proxy.get("/lifeguard/healthz")).status == 200
    # readinessProbe: not ready while there is no engine, so the Service sends nothing yet.
    assert (await proxy.get("/lifeguard/readyz")).status == 503

    await aiohttp_server(create_sim_app(SimSettings()), port=port)  # vLLM finishes loading
    for _ in range(300):
        ready = await proxy.get("/lifeguard/readyz")
        if ready.status == 200:
            break
        await asyncio.sleep(0.02)
    assert ready.status == 200
    assert (await (await proxy.get("/lifeguard/state")).json())["state"] == "RUNNING"
    assert (await proxy.get("/lifeguard/healthz")).status == 200
    completion = await proxy.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert completion.status == 200
