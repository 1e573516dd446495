"""vLLM 0.34's process-checkpoint routes (`vllm/entrypoints/serve/checkpoint/api_router.py`), attached whenever sleep
mode is on, with or without VLLM_SERVER_DEV_MODE (`entrypoints/launchers/api_server/routers.py`).

Each answers `CheckpointStateResponse` as `{"state": ..., "error": ...}` without a null error:

* `POST /checkpoint/prepare?mode=wait|abort|keep` (default wait): from RUNNING the engine starts preparing (a refusal
  is 400 with the state before and the reason); from PREPARING or PREPARED 200 (a repeat is a no-op); from RESTORING or
  FAILED 400. Otherwise 200 with the state read after the call: PREPARED when nothing had to drain, PREPARING while a
  wait-mode drain runs, or FAILED when the release failed.
* `POST /checkpoint/restore`: from PREPARING or FAILED 400; from PREPARED the engine restores (a failure is vLLM's
  500 `Call to checkpoint_restore method failed: ...`); then 200 with the state (a repeat is a no-op: RUNNING).
* `GET /checkpoint/status`: 200 only when PREPARED, 500 when FAILED, else 503.
"""

from __future__ import annotations

from aiohttp import web

from lifeguard_sim.checkpoint import CheckpointState
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response
from lifeguard_sim.routes_lifecycle import mode_query


async def prepare(request: web.Request) -> web.Response:
    mode = mode_query(request, default="wait")
    engine = request.app[SIM_ENGINE]
    engine.check_alive()
    state = engine.checkpoint.state
    if state is CheckpointState.RUNNING:
        if (refusal := await engine.checkpoint_prepare(mode)) is not None:
            return json_response({"state": str(state), "error": refusal}, status=400)
    elif state in (CheckpointState.RESTORING, CheckpointState.FAILED):
        return json_response(engine.checkpoint.body(), status=400)
    return json_response(engine.checkpoint.body())


async def restore(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    engine.check_alive()
    if engine.checkpoint.state in (CheckpointState.PREPARING, CheckpointState.FAILED):
        return json_response(engine.checkpoint.body(), status=400)
    if engine.checkpoint.state is CheckpointState.PREPARED:
        await engine.checkpoint_restore()
    return json_response(engine.checkpoint.body())


async def status(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    engine.check_alive()
    code = {CheckpointState.PREPARED: 200, CheckpointState.FAILED: 500}.get(engine.checkpoint.state, 503)
    return json_response(engine.checkpoint.body(), status=code)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/checkpoint/prepare", prepare)
    app.router.add_post("/checkpoint/restore", restore)
    app.router.add_get("/checkpoint/status", status, allow_head=False)
