"""The compiled data plane (docs/performance.md, "The compiled build"): a wheel or a non-editable `pip install .`
compiles the modules that `proxy/compiled.py` lists with mypyc when it can, and installs them pure when it cannot
(no C compiler, no Python headers, no mypyc: said in one line). An editable install never compiles: a stale `.so`
beside an edited `.py` would win at import. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
#: The commands that build a wheel or install from it; egg_info, dist_info, sdist and editable_wheel compile nothing.
BUILDING = {"bdist_wheel", "build", "build_ext", "install"}


def listed_modules() -> list[str]:
    """`MODULES` of proxy/compiled.py, read from its source: the package cannot be imported before it is built."""
    tree = ast.parse((HERE / "proxy" / "compiled.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODULES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit("proxy/compiled.py has no MODULES")


def why_pure() -> str | None:
    if os.environ.get("LIFEGUARD_PURE_PYTHON", "").strip().lower() not in ("", "0", "false", "no"):
        return "LIFEGUARD_PURE_PYTHON is set"
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        return f"no C compiler ({compiler.split()[0]})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "no Python headers (Python.h; python3-dev)"
    return None


def say_pure(why: str) -> None:
    print(f"vllm-lifeguard: installing the pure-Python build: {why}", file=sys.stderr)


class BuildOrFallBack(build_ext):
    """A failed compile installs the pure build instead of failing the install; what was built is taken out."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # the compiler's errors are several distutils classes
            for extension in self.extensions:
                Path(self.get_ext_fullpath(extension.name)).unlink(missing_ok=True)
            say_pure(f"compiling failed ({type(exc).__name__}; the compiler's own output is above)")


def extensions() -> list[Any]:
    if not BUILDING.intersection(sys.argv[1:]):
        return []
    why = why_pure()
    if why is None:
        try:
            from mypyc.build import mypycify
        except ImportError:
            why = "mypyc is not installed"
    if why is not None:
        say_pure(why)
        return []
    paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in listed_modules()]
    try:
        return list(mypycify(paths, opt_level="3", group_name="vllm_lifeguard"))
    except SystemExit as exc:  # mypy found a type error: its messages are printed above
        say_pure(f"mypyc refused the sources (exit {exc.code})")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildOrFallBack})
