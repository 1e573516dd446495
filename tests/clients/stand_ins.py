"""How tests/clients imports the trainers' HTTP modules, and only those, from their real packages.

The packages' `__init__` files import torch, Ray, vLLM and the trainers' whole stacks. So:

* `bare_packages("a.b.c")` registers `a`, `a.b`, `a.b.c` as plain packages over the installed folders,
  without running their `__init__` files. The modules inside are then imported unmodified.
* The few heavyweight names an HTTP module imports at its top are replaced by small stand-ins, each
  built by a function here named for what it replaces. None of them is on an HTTP path: they are the
  NCCL data path (TRL's trainer-side broadcast), logging helpers, or type annotations.
* `skyrl_remote_inference_client`, `trl_async_grpo_client`, `trl_server_mode_client` import the client
  classes this way; tests/clients (simulator) and tests/vllm/test_vllm_clients.py (real vLLM) share them.
* `definitions(path, names)` compiles chosen top-level definitions of a module whose imports are far too
  heavy (AReaL's `VLLMBackend` next to torch and Ray), unmodified, in a namespace of their own.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import importlib
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SITE_ENV = "LIFEGUARD_CLIENTS_SITE"
# The vLLM the proxy guards: TRL picks its code paths by vLLM version (trl_import_utils).
GUARDED_VLLM = (0, 32)
# The trainers' packages and the heavyweight packages stood in for. Ordinary libraries (requests, httpx)
# stay imported: re-importing them breaks their isinstance checks.
STAND_IN_ROOTS = frozenset({"skyrl", "trl", "areal", "accelerate", "torch", "transformers", "vllm"})


def client_site() -> Path:
    """The cached site directory scripts/test-clients.sh installed the trainers' packages into."""
    site = os.environ.get(SITE_ENV, "")
    if not site or not Path(site).is_dir():
        pytest.fail(f"{SITE_ENV}={site!r} is not a directory: run make test-clients")
    if site not in sys.path:
        sys.path.append(site)  # after the dev venv: the site only adds what the venv lacks
    return Path(site)


@contextlib.contextmanager
def modules_restored() -> Iterator[None]:
    """Stand-ins and client modules imported inside never leak into the next scenario."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in STAND_IN_ROOTS}
    try:
        yield
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in STAND_IN_ROOTS]:
            del sys.modules[name]
        sys.modules.update(saved)


def _package(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    return module


def bare_packages(site: Path, dotted: str) -> dict[str, types.ModuleType]:
    parts = dotted.split(".")
    found = {}
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        folder = site.joinpath(*parts[:depth])
        assert folder.is_dir(), f"{folder} is missing from the client site"
        found[name] = _package(name, folder)
    return found


def load(stand_ins: dict[str, types.ModuleType], module: str) -> types.ModuleType:
    """Import `module` unmodified with `stand_ins` in place; the stand-ins stay while the test runs."""
    sys.modules.update(stand_ins)
    return importlib.import_module(module)


# --- stand-ins, one per heavyweight name


def accelerate_logging() -> dict[str, types.ModuleType]:
    """`accelerate.logging.get_logger` (TRL's async GRPO client logs through it)."""
    module = types.ModuleType("accelerate.logging")
    module.get_logger = logging.getLogger  # type: ignore[attr-defined]
    return {"accelerate": _package("accelerate", Path("/nonexistent")), "accelerate.logging": module}


def trl_import_utils(vllm_version: tuple[int, int]) -> types.ModuleType:
    """`trl.import_utils`: TRL asks whether requests and vLLM are installed, and which vLLM. Answered for
    the vLLM the proxy guards, so TRL picks its code paths for that version."""
    module = types.ModuleType("trl.import_utils")

    def is_vllm_available(min_version: str | None = None) -> bool:
        if min_version is None:
            return True
        wanted = tuple(int(part) for part in min_version.split(".")[:2])
        return vllm_version >= wanted

    module.is_requests_available = lambda: True  # type: ignore[attr-defined]
    module.is_vllm_available = is_vllm_available  # type: ignore[attr-defined]
    return module


class _Device:
    def __init__(self, kind: str | _Device, index: int | None = None) -> None:
        text = kind.type if isinstance(kind, _Device) else kind
        self.type, _, number = text.partition(":")
        self.index = index if index is not None else (int(number) if number else None)


def torch_for_annotations() -> dict[str, types.ModuleType]:
    """`torch` and `torch.nn` as the trainers' HTTP paths use them: `torch.device` to check the trainer's
    device (TRL), names in annotations and module-level dtype constants (SkyRL 0.4.0's `sample_support` and
    `packed_tensor`, imported by its client module for type aliases), and, on SkyRL's trainer side, the CUDA
    and process-group calls around a weight send, on one process without a GPU."""
    torch = types.ModuleType("torch")
    nn = types.ModuleType("torch.nn")
    nn.Module = type("Module", (), {})  # type: ignore[attr-defined]
    cuda = types.SimpleNamespace(
        set_device=lambda device: None, is_available=lambda: False, empty_cache=lambda: None, current_device=lambda: 0
    )
    distributed = types.SimpleNamespace(
        is_available=lambda: False, is_initialized=lambda: False, get_rank=lambda: 0, barrier=lambda: None
    )
    torch.device = _Device  # type: ignore[attr-defined]
    torch.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]
    torch.Size = tuple  # type: ignore[attr-defined]
    torch.dtype = type("dtype", (), {})  # type: ignore[attr-defined]
    torch.int32, torch.long = "int32", "int64"  # type: ignore[attr-defined]
    torch.nn = nn  # type: ignore[attr-defined]
    torch.cuda = cuda  # type: ignore[attr-defined]
    torch.distributed = distributed  # type: ignore[attr-defined]
    return {"torch": torch, "torch.nn": nn}


def transformers_json_schema() -> dict[str, types.ModuleType]:
    """`transformers.utils.get_json_schema` (TRL's chat() turns tools into schemas; not used here)."""
    utils = types.ModuleType("transformers.utils")
    utils.get_json_schema = lambda function: {}  # type: ignore[attr-defined]
    return {"transformers": _package("transformers", Path("/nonexistent")), "transformers.utils": utils}


class NcclSide:
    """vLLM's trainer-side NCCL helpers TRL imports (`trainer_init`, `packed_nccl_broadcast_producer`):
    the tensor path that never crosses the proxy. Records what the trainer would have broadcast."""

    def __init__(self) -> None:
        self.groups: list[dict[str, Any]] = []
        self.broadcast: list[str] = []

    def trainer_init(self, init_info: dict[str, Any]) -> Any:
        self.groups.append(dict(init_info))
        return types.SimpleNamespace(group=types.SimpleNamespace(store=object(), socket=object()))

    def packed_nccl_broadcast_producer(
        self, iterator: Any, group: Any, src: int, post_iter_func: Callable[[Any], Any]
    ) -> None:
        self.broadcast.extend(name for name, _tensor in iterator)

    def modules(self) -> dict[str, types.ModuleType]:
        network = types.ModuleType("vllm.utils.network_utils")
        network.get_ip = lambda: "127.0.0.1"  # type: ignore[attr-defined]
        common = types.ModuleType("vllm.distributed.weight_transfer.nccl_common")
        common.trainer_init = self.trainer_init  # type: ignore[attr-defined]
        packed = types.ModuleType("vllm.distributed.weight_transfer.packed_tensor")
        packed.packed_nccl_broadcast_producer = self.packed_nccl_broadcast_producer  # type: ignore[attr-defined]
        nowhere = Path("/nonexistent")
        return {
            "vllm": _package("vllm", nowhere),
            "vllm.utils": _package("vllm.utils", nowhere),
            "vllm.utils.network_utils": network,
            "vllm.distributed": _package("vllm.distributed", nowhere),
            "vllm.distributed.weight_transfer": _package("vllm.distributed.weight_transfer", nowhere),
            "vllm.distributed.weight_transfer.nccl_common": common,
            "vllm.distributed.weight_transfer.packed_tensor": packed,
        }


# --- the client classes, imported unmodified from the client site


def skyrl_remote_inference_client(site: Path) -> Any:
    """`skyrl.backends.skyrl_train.inference_servers.remote_inference_client` (the module). SkyRL 0.4.0's imports
    torch (for type aliases of its R3 and sample-support side channels): stood in for by `torch_for_annotations`."""
    inference_servers = "skyrl.backends.skyrl_train.inference_servers"
    stand_ins = bare_packages(site, inference_servers)
    if not (site / "torch").is_dir():
        stand_ins.update(torch_for_annotations())
    return load(stand_ins, f"{inference_servers}.remote_inference_client")


def skyrl_weight_sync_control_plane(site: Path) -> Any:
    """`skyrl.backends.skyrl_train.weight_sync.control_plane` (SkyRL 0.4.0: `SkyrlWeightSyncClient`, the blocking
    client of vLLM's native weight-sync routes, `Connection: close` on every call)."""
    weight_sync = "skyrl.backends.skyrl_train.weight_sync"
    return load(bare_packages(site, weight_sync), f"{weight_sync}.control_plane")


def trl_async_grpo_client(site: Path) -> Any:
    """`trl.experimental.async_grpo.vllm_client.VLLMClient`."""
    stand_ins = {**bare_packages(site, "trl.experimental.async_grpo"), **accelerate_logging()}
    stand_ins["trl.import_utils"] = trl_import_utils(GUARDED_VLLM)
    return load(stand_ins, "trl.experimental.async_grpo.vllm_client").VLLMClient


def trl_server_mode_client(site: Path, nccl: NcclSide) -> Any:
    """`trl.generation.vllm_client.VLLMClient` (GRPO's `vllm_mode="server"`), its NCCL side stood in by `nccl`."""
    stand_ins = {**bare_packages(site, "trl.generation"), **torch_for_annotations(), **transformers_json_schema()}
    stand_ins.update(nccl.modules())
    stand_ins["trl.import_utils"] = trl_import_utils(GUARDED_VLLM)
    return load(stand_ins, "trl.generation.vllm_client").VLLMClient


def class_methods(path: Path, class_name: str, names: set[str], namespace: dict[str, Any]) -> type:
    """A class of the chosen methods of `class_name` in the module at `path`, compiled as written (the class's
    bases and other members left out: they need torch and Ray); `namespace` supplies what they use."""
    tree = ast.parse(path.read_text(), str(path))
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    assert found, f"{path} no longer defines {class_name}"
    methods = [
        node
        for node in found[0].body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names
    ]
    missing = names - {node.name for node in methods}
    assert not missing, f"{path}:{class_name} no longer defines {sorted(missing)}"
    cls = ast.ClassDef(name=class_name, bases=[], keywords=[], body=list(methods), decorator_list=[], type_params=[])
    code = compile(
        ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[])),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
    )
    exec(code, namespace)  # noqa: S102 - the trainer's own source, read from its installed package
    made: type = namespace[class_name]
    return made


def definitions(path: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile the top-level classes and functions `names` of the module at `path`, as written, into
    `namespace` (which supplies what they use). Annotations stay unevaluated strings."""
    tree = ast.parse(path.read_text(), str(path))
    chosen = [
        node
        for node in tree.body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names
    ]
    missing = names - {node.name for node in chosen}
    assert not missing, f"{path} no longer defines {sorted(missing)}"
    code = compile(
        ast.Module(body=chosen, type_ignores=[]), str(path), "exec", flags=__future__.annotations.compiler_flag
    )
    exec(code, namespace)  # noqa: S102 - the trainer's own source, read from its installed package
    return namespace
