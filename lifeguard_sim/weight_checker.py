"""vLLM's `POST /weight_checker` over the simulator's weights.

Mirrors vLLM 0.32 `vllm/entrypoints/rl/online/api_router.py` (`weight_checker`) and
`vllm/model_executor/model_loader/weight_checksum.py`: `{"action": "checksum"}` answers `{"checksums": {...}}`, a
SHA-256 per weight tensor keyed by the worker's ranks (`Worker._weight_checksum_prefix`, `dp0:pp0:pcp0:tp0:` for
the one worker); `compare` needs a `baseline` object (else 400) and answers `{"match", "mismatches"}` (sorted keys
whose digest differs, or that one side lacks); `reset` runs the workers' `reset_weights` through `collective_rpc`
(`zero_weights`: every weight set to zero) and answers `{"status": "reset"}`. `action` is a
`Literal["checksum", "reset", "compare"]` body field: a missing or unknown one is a 400 validation error.

The simulator has no tensors: a tensor's digest is a hash of its name and what the weights are
(`Engine.weights_held`), so equal
weights give equal digests and every change the engine makes (an update, a reload, a level-2 discard, a zeroing,
a `lie-weights` fault) shows as vLLM's would.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from lifeguard_sim import errors
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response

if TYPE_CHECKING:
    from lifeguard_sim.engine import Engine

#: The one worker's key prefix (data-parallel index, pipeline, prefill-context and tensor-parallel ranks).
PREFIX = "dp0:pp0:pcp0:tp0:"
#: The model's parameters, as `model.named_parameters()` names them for a small Llama.
TENSORS: tuple[str, ...] = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
)
#: The tensor a `lie-weights` fault gives other bytes.
ALTERED_TENSOR = TENSORS[4]
_ACTIONS = ("checksum", "reset", "compare")


def checksums(engine: Engine) -> dict[str, str]:
    held = engine.weights_held
    return {PREFIX + name: _digest(held, name, altered=engine.weights_altered) for name in TENSORS}


def _digest(held: str, name: str, *, altered: bool) -> str:
    content = f"{held}:{name}" + (":altered" if altered and name == ALTERED_TENSOR else "")
    return hashlib.sha256(content.encode()).hexdigest()


async def weight_checker(request: web.Request) -> web.Response:
    engine: Engine = request.app[SIM_ENGINE]
    body = errors.json_object(await request.read())
    action = body.get("action")
    if "action" not in body:
        raise errors.validation_error("body.action", "missing", "Field required", "")
    if action not in _ACTIONS:
        expected = "'checksum', 'reset' or 'compare'"
        raise errors.validation_error(
            "body.action", "literal_error", f"Input should be {expected}", str(action), {"expected": expected}
        )
    baseline: Any = body.get("baseline")
    if baseline is not None and not (isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())):
        raise errors.validation_error("body.baseline", "dict_type", "Input should be a valid dictionary", str(baseline))
    if action == "reset":
        await engine.collective_rpc("reset_weights")
        return json_response({"status": "reset"})
    if action == "compare" and baseline is None:
        raise errors.bad_request("action='compare' requires a 'baseline' object")
    engine.check_alive()
    engine.counters["weight_checksums"] += 1
    if "weights" in engine.memory_asleep:
        engine.violate("weight_checksum_while_asleep", "/weight_checker read weights that are asleep")
    digests = checksums(engine)
    if action == "checksum":
        return json_response({"checksums": digests})
    assert baseline is not None
    differ = sorted(key for key in digests.keys() | baseline.keys() if digests.get(key) != baseline.get(key))
    return json_response({"match": not differ, "mismatches": differ})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/weight_checker", weight_checker)
