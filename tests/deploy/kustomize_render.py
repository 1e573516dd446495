"""A small, offline stand-in for `kustomize build`, enough for deploy/k8s (no kustomize binary here).

Supports exactly what our kustomizations use: resources (files and directories), components,
configMapGenerator (envs and files; no name hash: references stay consistent by construction),
labels (metadata and pod templates, never selectors), images, and strategic-merge patches from files,
with the merge keys of the Pod fields we patch. Anything else in a kustomization is an error, so the
renderer never silently ignores a feature it does not implement.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "configMapGenerator",
    "labels",
    "images",
    "patches",
}
# Strategic-merge keys of the list fields our patches touch (from the Kubernetes API's patchMergeKey).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}

Resource = dict[str, Any]


def read_kustomization(directory: Path) -> dict[str, Any]:
    data = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(data) - SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomization keys this renderer does not implement: {unknown}")
    return data


def referenced_files(directory: Path) -> list[Path]:
    """Every path a kustomization names (resources, components, patches, generator sources)."""
    data = read_kustomization(directory)
    paths = [directory / entry for entry in data.get("resources", []) + data.get("components", [])]
    paths += [directory / patch["path"] for patch in data.get("patches", [])]
    for generator in data.get("configMapGenerator", []):
        paths += [directory / source for source in generator.get("envs", [])]
        paths += [directory / source.split("=", 1)[-1] for source in generator.get("files", [])]
    return paths


def build(directory: Path, extra_components: tuple[Path, ...] = ()) -> list[Resource]:
    data = read_kustomization(directory)
    resources: list[Resource] = []
    for entry in data.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources += build(path)
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    resources += [_config_map(directory, generator) for generator in data.get("configMapGenerator", [])]
    for component in [directory / entry for entry in data.get("components", [])] + list(extra_components):
        resources = _apply_component(component, resources)
    resources = _apply_patches(directory, data, resources)
    for label in data.get("labels", []):
        _apply_labels(resources, label)
    for image in data.get("images", []):
        _apply_image(resources, image)
    return resources


def _apply_component(directory: Path, resources: list[Resource]) -> list[Resource]:
    data = read_kustomization(directory)
    if data.get("kind") != "Component":
        raise ValueError(f"{directory} is not a kind: Component")
    added = [doc for entry in data.get("resources", []) for doc in yaml.safe_load_all((directory / entry).read_text())]
    added += [_config_map(directory, generator) for generator in data.get("configMapGenerator", [])]
    return _apply_patches(directory, data, resources + [doc for doc in added if doc])


def _apply_patches(directory: Path, data: dict[str, Any], resources: list[Resource]) -> list[Resource]:
    for patch in data.get("patches", []):
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = find(resources, body["kind"], body["metadata"]["name"])
        merged = strategic_merge(target, body)
        resources = [merged if doc is target else doc for doc in resources]
    return resources


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = strategic_merge(merged[name], value, name)
            else:
                merged[name] = _without_directives(copy.deepcopy(value))
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        merged_list = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, old in enumerate(merged_list) if old.get(merge_key) == item[merge_key]), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    merged_list.pop(index)
            elif index is None:
                merged_list.append(_without_directives(copy.deepcopy(item)))
            else:
                merged_list[index] = strategic_merge(merged_list[index], item, None)
        return merged_list
    return _without_directives(copy.deepcopy(patch))


def _without_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if not k.startswith("$patch")}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return value


def _config_map(directory: Path, generator: dict[str, Any]) -> Resource:
    data: dict[str, str] = {}
    for source in generator.get("envs", []):
        for line in (directory / source).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                if name in data:
                    raise ValueError(f"{source}: {name} given twice")
                data[name] = value
    for source in generator.get("files", []):
        name, _, path = source.rpartition("=")
        data[name or Path(path).name] = (directory / path).read_text()
    metadata: dict[str, Any] = {"name": generator["name"]}
    for key in ("labels", "annotations"):
        if generator.get("options", {}).get(key):
            metadata[key] = dict(generator["options"][key])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _apply_labels(resources: list[Resource], label: dict[str, Any]) -> None:
    if label.get("includeSelectors"):
        raise ValueError("labels with includeSelectors would rewrite immutable selectors")
    for doc in resources:
        doc["metadata"].setdefault("labels", {}).update(label["pairs"])
        template = doc.get("spec", {}).get("template") if label.get("includeTemplates") else None
        if template is not None:
            template.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])


def _apply_image(resources: list[Resource], image: dict[str, Any]) -> None:
    for doc in resources:
        for container in pod_containers(doc):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def pod_containers(doc: Resource) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    matches = [doc for doc in resources if doc["kind"] == kind and doc["metadata"]["name"] == name]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} resources of kind {kind} named {name}")
    return matches[0]
