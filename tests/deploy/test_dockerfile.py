"""The Dockerfile, checked without a Docker engine: structure, and that its build context is complete."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [
    line.strip()
    for line in re.sub(r"\\\n\s*", " ", DOCKERFILE).splitlines()
    if line.strip() and not line.startswith("#")
]


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in INSTRUCTIONS:
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def _final() -> list[str]:
    return _stages()[-1]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a match on a parent covers children."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, glob[3:]) for part in parts)
        else:
            hit = any(
                len(c.split("/")) == len(glob.split("/"))
                and all(fnmatch.fnmatch(a, b) for a, b in zip(c.split("/"), glob.split("/"), strict=True))
                for c in candidates
            )
        if hit:
            ignored = not negate
    return ignored


def test_the_base_image_is_a_pinned_slim_python() -> None:
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, "the base image is one ARG used by both stages"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-(bookworm|trixie)", match.group(1))
    assert [stage[0].split()[1] for stage in _stages()] == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]


def test_the_final_stage_copies_only_the_venv_from_the_builder() -> None:
    copies = [line for line in _final() if line.startswith("COPY")]
    assert copies == ["COPY --from=builder /opt/lifeguard /opt/lifeguard"]
    assert not [line for line in _final() if re.search(r"\b(apt-get|pip|gcc|build-essential)\b", line)]


def test_it_runs_as_a_non_root_user_with_the_cli_as_entrypoint() -> None:
    final = _final()
    user = next(line for line in final if line.startswith("USER "))
    assert user.split()[1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["vllm-lifeguard"]' in final
    assert 'CMD ["serve"]' in final


def test_it_listens_on_all_interfaces_on_the_exposed_port_and_checks_healthz() -> None:
    final = " ".join(_final())
    port = re.search(r"LIFEGUARD_PORT=(\d+)", final)
    assert port and re.search(rf"\bEXPOSE {port.group(1)}\b", final)
    assert "LIFEGUARD_HOST=0.0.0.0" in final
    healthcheck = next(line for line in _final() if line.startswith("HEALTHCHECK"))
    assert "/lifeguard/healthz" in healthcheck and "urllib" in healthcheck
    assert "curl" not in healthcheck and "wget" not in healthcheck


def test_every_copied_source_exists_and_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for line in INSTRUCTIONS:
        if line.startswith("COPY ") and "--from=" not in line:
            sources += shlex.split(line)[1:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: missing from the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    package = [p.relative_to(ROOT).as_posix() for p in (ROOT / "proxy").rglob("*.py")]
    assert package and not [p for p in package if _ignored(p, patterns)]
    assert _ignored(".venv/bin/python", patterns) and _ignored("tests/deploy/test_dockerfile.py", patterns)
    assert _ignored("proxy/__pycache__/app.cpython-311.pyc", patterns)


def test_hadolint_is_clean() -> None:
    hadolint = ROOT / ".venv" / "bin" / "hadolint"
    if not hadolint.exists() and os.environ.get("CHECK_DEPLOY") != "1":
        pytest.skip("hadolint not installed (scripts/check-deploy.sh installs it)")
    result = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
