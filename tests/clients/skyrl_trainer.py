"""SkyRL 0.4.0's trainer side of a weight sync, assembled from its own source as far as it runs without a GPU.

SkyRL's own code, compiled unmodified from the installed wheel (`stand_ins.definitions`, `class_methods`):

* `WorkerDispatch` (`workers/worker_dispatch.py`): `save_weights_for_sampler` picks the flow (colocated with
  `/is_sleeping` first; non-colocated with `offload_kv_for_weight_sync`, fully async or not; plain pause /
  resume; the delta backend) and drives `RemoteInferenceClient` around the weight send;
* `Worker._sync_weights_to_inference_engines` and its helpers (`workers/worker.py`): the worker's side, with
  the prefix-cache reset;
* `SkyrlTrainerCapabilities` and `SkyrlDraftSessionMixin` (`weight_sync/weight_senders.py`): the drafter's
  second session (`/start_draft_weight_update`);
* `DeltaTrainerWeightTransferEngine` (`weight_sync/delta/trainer.py`): `trainer_init` and
  `_apply_receiver_update` (`/fetch_weights` before the pause, then the four phases, drafter too);
* `SkyrlWeightSyncClient` (`weight_sync/control_plane.py`), the blocking client that makes those calls.

Stood in for: Ray (`ray.get` of an actor call runs it here, blocking the caller as Ray does), torch (no CUDA,
one rank), and vLLM's trainer engines, whose `send_weights` is written below after vLLM 0.32
(`vllm/distributed/weight_transfer/nccl_engine.py`, `ipc_engine.py`): the tensors never cross the proxy, so
the broadcast is a rendezvous that waits until the inference side has received its `/update_weights`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import sys
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Optional, TypeVar

from tests.clients.stand_ins import class_methods, definitions, torch_for_annotations

SKYRL_TRAIN = "skyrl/backends/skyrl_train"
RENDEZVOUS_DEADLINE_S = 10.0


# --- vLLM 0.32's trainer side (vllm/distributed/weight_transfer/base.py), as SkyRL's classes subclass it


@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


T = TypeVar("T")


class TrainerWeightTransferEngine(abc.ABC, Generic[T]):
    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        self.is_sender = is_sender
        self.client = client
        self.source = source


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]


class WeightSource:
    """vLLM's `WeightSource`: what the trainer sends, here names and shapes only."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, "torch.bfloat16", (4, 4)) for name in self.names]


def _sim_count(sim_url: str, counter: str) -> int:
    with urllib.request.urlopen(f"{sim_url}/sim/state", timeout=5) as response:  # noqa: S310 - loopback
        counters: dict[str, int] = json.load(response)["counters"]
    return counters.get(counter, 0)


class NcclSend(TrainerWeightTransferEngine[Any]):
    """`NCCLTrainerWeightTransferEngine.send_weights` (vLLM 0.32): start, then `/update_weights` on a thread while
    the trainer broadcasts (both sides meet inside the NCCL calls), then finish."""

    sim_url = ""

    def send_weights(self) -> None:
        meta = self.source.metadata()
        update_info = {
            "names": [m.name for m in meta],
            "dtype_names": [m.dtype.split(".")[-1] for m in meta],
            "shapes": [list(m.shape) for m in meta],
            "packed": True,
        }
        before = _sim_count(self.sim_url, "update_weights")
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, update_info)
            self._broadcast(before)
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()

    def _broadcast(self, before: int) -> None:
        """The NCCL rendezvous: the broadcast completes once the inference side has joined, i.e. once vLLM has
        received this round's `/update_weights`. A proxy that held it would hang NCCL: here, a named failure."""
        deadline = time.monotonic() + RENDEZVOUS_DEADLINE_S
        while _sim_count(self.sim_url, "update_weights") <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the inference side never joined the broadcast within {RENDEZVOUS_DEADLINE_S:g} s: "
                    "/update_weights did not reach vLLM"
                )
            time.sleep(0.01)


class IpcSend(TrainerWeightTransferEngine[Any]):
    """`IPCTrainerWeightTransferEngine.send_weights` (vLLM 0.32, packed): start, one `/update_weights` per packed
    chunk with its CUDA IPC handle (pickled into `ipc_handles_pickled` by SkyRL's client), finish."""

    chunk_size = 2

    def send_weights(self) -> None:
        meta = self.source.metadata()
        self.client.start_weight_update()
        for at in range(0, len(meta), self.chunk_size):
            chunk = meta[at : at + self.chunk_size]
            self.client.update_weights(
                {
                    "names": [m.name for m in chunk],
                    "dtype_names": [m.dtype.split(".")[-1] for m in chunk],
                    "shapes": [list(m.shape) for m in chunk],
                    "ipc_handles": {"GPU-sim-0": ("rebuild_cuda_tensor", at)},
                    "tensor_sizes": [32 for _ in chunk],
                }
            )
        self.client.finish_weight_update()


# --- SkyRL's own classes


def _skyrl_weight_senders(site: Path) -> types.ModuleType:
    """`weight_sync/weight_senders.py`'s trainer capabilities, drafter mixin and `maybe_set_reset_prefix_cache`
    (the module imports vLLM's packed-tensor code at its top; these three do not use it)."""
    module = types.ModuleType("skyrl.backends.skyrl_train.weight_sync.weight_senders")
    namespace = module.__dict__
    namespace.update({"Any": Any, "Optional": Optional, "WeightSource": WeightSource})
    names = {"SkyrlTrainerCapabilities", "SkyrlDraftSessionMixin", "maybe_set_reset_prefix_cache"}
    definitions(site / SKYRL_TRAIN / "weight_sync/weight_senders.py", names, namespace)
    return module


@dataclass
class SkyrlTrainerSide:
    """The classes a test drives, built once per test from the client site."""

    weight_senders: types.ModuleType
    control_plane: Any
    worker_dispatch: type
    worker: type
    delta_init_info: type
    delta_engine: type

    def engine(self, backend: str, client: Any, names: list[str], *, draft: list[str] | None, sim_url: str) -> Any:
        """SkyRL's `skyrl_nccl` / `skyrl_ipc` trainer engine (weight_senders.py: the drafter mixin and the
        capabilities over vLLM's engine), with a drafter source under speculative decoding."""
        base = {"nccl": NcclSend, "ipc": IpcSend}[backend]
        senders = self.weight_senders
        cls = type(
            f"Skyrl{backend.upper()}TrainerWeightTransferEngine",
            (senders.SkyrlDraftSessionMixin, senders.SkyrlTrainerCapabilities, base),
            {"sim_url": sim_url},
        )
        engine = cls(client=client, source=WeightSource(names))
        engine.skyrl_draft_source = WeightSource(draft) if draft else None
        return engine


def skyrl_trainer_side(site: Path) -> SkyrlTrainerSide:
    torch = torch_for_annotations()["torch"]
    senders = _skyrl_weight_senders(site)
    sys.modules[senders.__name__] = senders  # Worker._sync_weights_to_inference_engines imports from it
    from tests.clients.stand_ins import skyrl_weight_sync_control_plane

    control_plane = skyrl_weight_sync_control_plane(site)
    logger = logging.getLogger("skyrl")
    ray = types.SimpleNamespace(get=lambda refs: refs)
    dispatch_ns: dict[str, Any] = {"ray": ray, "logger": logger, "time": time, "dataclass": dataclass}
    dispatch_ns.update({"Optional": Optional, "Any": Any, "TYPE_CHECKING": False})
    definitions(site / SKYRL_TRAIN / "workers/worker_dispatch.py", {"GPUState", "WorkerDispatch"}, dispatch_ns)
    worker_ns: dict[str, Any] = {"torch": torch, "asyncio": asyncio}
    worker = class_methods(
        site / SKYRL_TRAIN / "workers/worker.py",
        "Worker",
        {
            "_weight_sync_thread",
            "_should_reset_prefix_cache",
            "_reset_prefix_cache_task",
            "_sync_weights_to_inference_engines",
        },
        worker_ns,
    )
    # A module of its own: dataclasses reads `ClassVar` in the module of the class (annotations are strings).
    delta = types.ModuleType("skyrl.backends.skyrl_train.weight_sync.delta.trainer")
    sys.modules[delta.__name__] = delta
    delta_ns = delta.__dict__
    delta_ns.update(
        {
            "dataclass": dataclass,
            "ClassVar": ClassVar,
            "Optional": Optional,
            "TrainerInitInfo": TrainerInitInfo,
            "TrainerWeightTransferEngine": TrainerWeightTransferEngine,
            "SkyrlTrainerCapabilities": senders.SkyrlTrainerCapabilities,
            "torch": torch,
            "logger": logger,
            "DELTA_BACKEND": "delta",
        }
    )
    definitions(
        site / SKYRL_TRAIN / "weight_sync/delta/trainer.py",
        {"DeltaTrainerInitInfo", "DeltaTrainerWeightTransferEngine"},
        delta_ns,
    )
    return SkyrlTrainerSide(
        senders,
        control_plane,
        dispatch_ns["WorkerDispatch"],
        worker,
        delta_ns["DeltaTrainerInitInfo"],
        delta_ns["DeltaTrainerWeightTransferEngine"],
    )


# --- the actors Ray would run


def config(*, colocate_all: bool, backend: str = "nccl", offload_kv: bool = False, fully_async: bool = False) -> Any:
    """The parts of `SkyRLTrainConfig` the dispatch and the worker read."""
    ns = types.SimpleNamespace
    inference_engine = ns(
        weight_sync_backend=backend, offload_kv_for_weight_sync=offload_kv, enable_prefix_caching=True
    )
    trainer = ns(
        placement=ns(colocate_all=colocate_all, colocate_policy_ref=False),
        strategy="fsdp",
        policy=ns(model=ns(lora=ns(rank=0)), optimizer_config=ns(offload_after_step=True)),
        fully_async=ns(enabled=fully_async, clear_kv_cache_on_weight_sync=False),
    )
    return ns(trainer=trainer, generator=ns(inference_engine=inference_engine))


class PolicyActorGroup:
    """The policy's Ray actor group, one rank: `async_run_ray_method("pass_through", name, ...)` runs the worker's
    method to completion on a thread of its own, blocking the caller as `ray.get` does."""

    def __init__(self, side: SkyrlTrainerSide, cfg: Any, engine: Any, new_client: Callable[[], Any]) -> None:
        worker_cls = type("FsdpPolicyWorker", (side.worker,), {"_expandable_segments_disabled_for_sync": _no_toggle})
        self.worker = worker_cls()
        self.worker.cfg = cfg.trainer
        self.worker._weight_sync_engine = engine
        self._new_client = new_client
        self.placements: list[str] = []

    def async_run_ray_method(self, kind: str, method: str, *args: Any, **kwargs: Any) -> Any:
        assert kind == "pass_through", kind
        if method == "broadcast_to_inference_engines":
            _client, inference_engine_cfg = args
            with ThreadPoolExecutor(max_workers=1) as actor:
                return actor.submit(asyncio.run, self._broadcast(inference_engine_cfg)).result()
        if method == "empty_cache":
            return None
        raise AssertionError(f"unexpected actor call {method}")

    async def _broadcast(self, inference_engine_cfg: Any) -> None:
        """`FSDPPolicyWorker.broadcast_to_inference_engines` without LoRA: the worker's own client (a copy of the
        driver's, on the actor's event loop)."""
        async with self._new_client() as client:
            await self.worker._sync_weights_to_inference_engines(client, inference_engine_cfg)

    def offload_to_cpu(self, **kwargs: Any) -> None:
        self.placements.append("offload")

    def backload_to_gpu(self, **kwargs: Any) -> None:
        self.placements.append("backload")


@contextlib.contextmanager
def _no_toggle(self: Any, force: bool = False) -> Iterator[None]:
    yield
