"""Which build of the data plane runs: compiled with mypyc, or pure Python (docs/performance.md, "The compiled
build").

`MODULES` is the one list of what is compiled: setup.py reads it (without importing the package) to build them, and
this module reads it to say which build runs. The sources stay in the package beside the compiled modules, so
`LIFEGUARD_PURE_PYTHON=1` runs the very same code uncompiled: `proxy/__init__.py` calls `keep_pure_if_asked`
before any of them is imported, and the import system then takes each one's `.py` over its `.so`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from pathlib import Path
from types import ModuleType

#: What a forwarded request or a relayed event runs per call (`python -m benchmarks.hotpath --profile`), and the
#: modules whose classes subclass one of theirs (an interpreted class cannot inherit from a compiled one).
MODULES = (
    "proxy.front.answered",
    "proxy.front.connection",
    "proxy.front.dispatcher",
    "proxy.front.exchange",
    "proxy.front.held",
    "proxy.front.request_reader",
    "proxy.front.routing",
    "proxy.front.serialized",
    "proxy.front.versioned",
    "proxy.front.wire",
    "proxy.lifecycle.gate",
    "proxy.lifecycle.inflight",
    "proxy.observe.request_metrics",
    "proxy.upstream.pool",
)
PURE_VARIABLE = "LIFEGUARD_PURE_PYTHON"


def pure_asked() -> bool:
    return os.environ.get(PURE_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


class _SourcesFirst(MetaPathFinder):
    """Finds each module of `MODULES` as its `.py`, so that the `.so` beside it is not loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in MODULES or path is None:
            return None
        leaf = fullname.rpartition(".")[2]
        for folder in path:
            source = Path(folder) / f"{leaf}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def keep_pure_if_asked() -> None:
    if pure_asked() and not any(isinstance(finder, _SourcesFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst())


def compiled_modules() -> list[str]:
    """The modules of `MODULES` that run compiled (found as an extension module), imported or not yet."""
    found = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(tuple(EXTENSION_SUFFIXES)):
            found.append(name)
    return found


def build() -> str:
    """The build that runs, as `/lifeguard/state` says it: `compiled`, `pure` (nothing was compiled where this was
    installed, or `LIFEGUARD_PURE_PYTHON` asked for it) or `partly compiled` (an install that lost some of them)."""
    count = len(compiled_modules())
    return "compiled" if count == len(MODULES) else "pure" if count == 0 else "partly compiled"


def build_said() -> str:
    """The build that runs, as the version and the start line say it: `compiled build`, `pure build`, and why."""
    count = len(compiled_modules())
    if 0 < count < len(MODULES):
        return f"partly compiled build ({count} of {len(MODULES)} modules)"
    return f"{build()} build" + (f", {PURE_VARIABLE}" if pure_asked() else "")
