"""Print every (method, path) route the installed vLLM can serve, as JSON lines, for the route-table test.

Run with the vLLM venv's python. It builds vLLM's own FastAPI app (`vllm.entrypoints.launchers.app.build_app`)
with every task and every route-adding switch on (dev mode, runtime LoRA updating, fault tolerance, the
tokenizer-info endpoint, a profiler), so routes that a deployment only gets with a flag are listed too.
No engine is started: building the app only registers routes.
"""

from __future__ import annotations

import json
import os
import sys
import typing

os.environ["VLLM_SERVER_DEV_MODE"] = "1"
os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"

from starlette.routing import Mount, Route  # noqa: E402
from vllm.entrypoints.launchers.app import build_app  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.tasks import SupportedTask  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def _all_tasks() -> tuple[str, ...]:
    tasks: list[str] = []
    for alias in typing.get_args(SupportedTask):
        tasks.extend(typing.get_args(alias) or (alias,))
    return tuple(tasks)


def main() -> int:
    parser = make_arg_parser(FlexibleArgumentParser())
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": "/nonexistent-lifeguard-profile"})
    args = parser.parse_args(
        ["--enable-fault-tolerance", "--enable-tokenizer-info-endpoint", "--profiler-config", profiler]
    )
    app = build_app(args, supported_tasks=_all_tasks())  # type: ignore[arg-type]
    for route in app.routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                print(json.dumps({"method": method, "path": route.path, "in_schema": route.include_in_schema}))
        elif isinstance(route, Mount):
            print(json.dumps({"method": "*", "path": route.path, "in_schema": False}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
