"""The package's build (pyproject.toml, setup.py): without a C compiler it installs the pure build and says so in one
line, and the compiled build's type check sees the runtime dependencies (setup.py compiles what `make lint` checks)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_requires_every_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    missing = set(project["project"]["dependencies"]) - set(project["build-system"]["requires"])
    assert not missing, f"mypyc type-checks the package against these: add them to [build-system] requires: {missing}"


def test_without_a_c_compiler_the_wheel_is_pure_and_says_so_once(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("proxy", "lifeguard_sim"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), source],
        env={"PATH": "/usr/bin:/bin", "CC": "/nonexistent/cc", "HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=100, check=True,
    )  # fmt: skip
    said = [
        line.strip()
        for line in (built.stdout + built.stderr).splitlines()
        if line.strip().startswith("vllm-lifeguard:")
    ]
    assert said == ["vllm-lifeguard: installing the pure-Python build: no C compiler (/nonexistent/cc)"]
    wheel = next(tmp_path.glob("vllm_lifeguard-*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "proxy/front/dispatcher.py" in names and not [name for name in names if name.endswith(".so")]
