"""The compiled data plane (proxy/compiled.py, setup.py): the build `make test` says it runs is the one that loaded,
`LIFEGUARD_PURE_PYTHON=1` runs the sources even where the compiled modules are installed, and the version and
`/lifeguard/state` say which build runs."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from proxy import __version__
from proxy.compiled import MODULES, PURE_VARIABLE, build, build_said
from tests.e2e.conftest import Stack

BIN = Path(sys.executable).with_name("vllm-lifeguard")
#: `make test` names the build each of its runs is meant to test: `compiled` (PYTHONPATH=build/compiled) or `pure`.
EXPECTED = os.environ.get("LIFEGUARD_TEST_BUILD")


def loaded_from(name: str) -> str:
    return str(importlib.import_module(name).__file__)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment and import path, for a child run outside the repository (whose `proxy/` a child
    started in it would import first)."""
    env = {key: value for key, value in os.environ.items() if key != PURE_VARIABLE}
    return {**env, "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry), **extra}


def test_the_build_that_loaded_is_the_one_built() -> None:
    compiled = [name for name in MODULES if loaded_from(name).endswith(tuple(EXTENSION_SUFFIXES))]
    if EXPECTED == "compiled":  # where the modules were built, every one of them loaded compiled
        assert compiled == list(MODULES), [loaded_from(name) for name in MODULES]
        assert build() == "compiled"
    elif EXPECTED == "pure":
        assert compiled == [] and build() == "pure"
    else:
        assert compiled in ([], list(MODULES)), f"partly compiled: {compiled}"


def test_lifeguard_pure_python_runs_the_sources_and_the_version_says_so(tmp_path: Path) -> None:
    probe = "import importlib, proxy.compiled as c; print(c.build()); "
    probe += "print(*(importlib.import_module(m).__file__ for m in c.MODULES))"
    pure = subprocess.run(
        [sys.executable, "-c", probe],
        env=child_env(LIFEGUARD_PURE_PYTHON="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert pure[0] == "pure"
    assert all(file.endswith(".py") for file in pure[1].split()), pure[1]
    version = subprocess.run(
        [str(BIN), "--version"], env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert (
        version.strip()
        == f"vllm-lifeguard {__version__} ({build()} build)"
        == f"vllm-lifeguard {__version__} ({build_said()})"
    )
    forced = subprocess.run(
        [str(BIN), "--version"], env=child_env(LIFEGUARD_PURE_PYTHON="1"), cwd=tmp_path,
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert forced.strip() == f"vllm-lifeguard {__version__} (pure build, {PURE_VARIABLE})"


async def test_the_state_says_which_build_runs(make_stack: Callable[..., Awaitable[Stack]]) -> None:
    stack = await make_stack()
    assert (await stack.state())["build"] == build()
