"""TRL's own async-GRPO HTTP client (`trl.experimental.async_grpo.vllm_client.VLLMClient`) drives the
proxy in front of the simulator, in the order TRL's `WeightTransferClient` calls it.

TRL's package pulls in torch, transformers and accelerate, far too much for CPU CI. The client module
itself needs only `requests`, accelerate's `get_logger` and TRL's `is_requests_available`, so it is
loaded unmodified from the pinned wheel (scripts/check-deploy.sh downloads it; path in TRL_WHEEL) with
those two imports provided by tiny stand-ins. The NCCL side (`WeightTransferClient`, which needs
vLLM) is not run: its HTTP calls are, in its order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.config import Settings
from proxy.sim.app import SIM_ENGINE, SimSettings, create_sim_app

CLIENT_MODULE = "trl/experimental/async_grpo/vllm_client.py"
GUIDE_SYNC = ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]


@pytest.fixture
def trl_client(tmp_path: Path) -> Iterator[Any]:
    wheel = os.environ.get("TRL_WHEEL", "")
    if not Path(wheel).is_file():
        if os.environ.get("CHECK_DEPLOY") == "1":
            pytest.fail(f"TRL_WHEEL={wheel!r} is missing; scripts/check-deploy.sh should have downloaded it")
        pytest.skip("TRL's wheel is not downloaded (scripts/check-deploy.sh does it)")
    pytest.importorskip("requests")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(CLIENT_MODULE, tmp_path)
    package_dir = tmp_path / "trl"

    def package(name: str, path: Path) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]  # a package, without running TRL's __init__ files (torch imports)
        return module

    logging_module = types.ModuleType("accelerate.logging")
    logging_module.get_logger = logging.getLogger  # type: ignore[attr-defined]
    import_utils = types.ModuleType("trl.import_utils")
    import_utils.is_requests_available = lambda: True  # type: ignore[attr-defined]
    stand_ins = {
        "accelerate": package("accelerate", tmp_path / "accelerate"),
        "accelerate.logging": logging_module,
        "trl": package("trl", package_dir),
        "trl.import_utils": import_utils,
        "trl.experimental": package("trl.experimental", package_dir / "experimental"),
        "trl.experimental.async_grpo": package("trl.experimental.async_grpo", package_dir / "experimental/async_grpo"),
    }
    saved = {name: sys.modules.get(name) for name in [*stand_ins, "trl.experimental.async_grpo.vllm_client"]}
    sys.modules.update(stand_ins)
    try:
        import importlib

        yield importlib.import_module("trl.experimental.async_grpo.vllm_client").VLLMClient
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


async def test_trl_async_grpo_client_runs_its_weight_sync_through_the_proxy(
    trl_client: Any, aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.upper().startswith("LIFEGUARD_"):
            monkeypatch.delenv(name)
    gpu_file = tmp_path / "gpu.json"
    sim_app = create_sim_app(SimSettings(gpu_file=gpu_file))
    sim = await aiohttp_server(sim_app)
    settings = Settings(upstream=str(sim.make_url("")), gpu_probe=f"file:{gpu_file}", canary_enabled=False)
    proxy_app = create_app(settings)
    received: list[str] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        received.append(request.path_qs)
        return await handler(request)

    proxy_app.middlewares.append(record)
    proxy = await aiohttp_server(proxy_app)

    def trainer() -> int:
        """What AsyncGRPOTrainer and WeightTransferClient ask of VLLMClient, in their order."""
        client = trl_client(str(proxy.make_url("")), server_timeout=10)
        client.wait_for_server_ready(poll_interval_s=0.05)
        max_model_len = client.get_max_model_len()
        world_size = client.get_world_size()
        init_info = {"master_address": "127.0.0.1", "master_port": 29551, "rank_offset": 1}
        client.init_weight_transfer_engine({**init_info, "world_size": world_size + 1, "packed": True})
        update_info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}
        for _ in range(2):  # two weight syncs; every call raises unless it got a 200
            client.pause(timeout=10)
            client.start_weight_update(timeout=10)
            client.update_weights(update_info, timeout=10)
            client.finish_weight_update(timeout=10)
            client.resume(timeout=10)
        return int(max_model_len)

    assert await asyncio.wait_for(asyncio.to_thread(trainer), timeout=60) == 16384

    lifecycle = [path for path in received if path.split("?")[0] in {p.split("?")[0] for p in GUIDE_SYNC}]
    assert lifecycle == GUIDE_SYNC * 2, "TRL's client no longer sends what docs/guides/trl.md documents"
    async with proxy_client(proxy) as session:
        async with session.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 4}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "length"
        async with session.get("/lifeguard/state") as r:
            assert (await r.json())["state"] == "RUNNING"
    assert sim_app[SIM_ENGINE].state_dict()["violations"] == []


def proxy_client(server: Any) -> Any:
    import aiohttp

    return aiohttp.ClientSession(base_url=str(server.make_url("")))
