"""What the code says exists: settings, routes, headers, error reasons, metrics and their label values, make
targets. Read from the code itself (imports and, for what has no registry, the sources), never from the docs.

Used by scripts/docs/reference.py (the generated reference, `make docs`) and tests/tooling/test_doc_lint.py (every
name the docs mention must be here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
#: Where the code lives (what a name the docs mention must be found in).
CODE_DIRS = ("proxy", "lifeguard_sim", "benchmarks", "scripts", "tests", "deploy", "config")
CODE_FILES = ("Makefile", "Dockerfile", "pyproject.toml")
#: Files that name things only to check them: a name found only there does not exist.
NOT_CODE = frozenset({"tests/tooling/test_doc_lint.py", "scripts/docs/facts.py", "scripts/docs/reference.py"})
CODE_SUFFIXES = frozenset({".py", ".sh", ".yaml", ".yml", ".json", ".toml", ".html", ".lua", ".in", ".cfg"})
HEADER_RE = re.compile(r"X-Lifeguard-[A-Za-z][A-Za-z-]*[A-Za-z]")
ENV_RE = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b")
#: Metric sample suffixes prometheus_client adds to a family's name.
SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")


@cache
def code_files() -> tuple[Path, ...]:
    return tuple(_code_files())


def _code_files() -> Iterator[Path]:
    """Every source file of the repository (not the docs)."""
    for name in CODE_FILES:
        yield ROOT / name
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if (
                path.is_file()
                and (path.suffix in CODE_SUFFIXES or path.suffix == "")
                and "__pycache__" not in path.parts
                and path.relative_to(ROOT).as_posix() not in NOT_CODE
            ):
                yield path


@cache
def code_text() -> str:
    """All the code as one text, for "does this name appear anywhere in the code"."""
    parts = []
    for path in code_files():
        try:
            parts.append(path.read_text())
        except (UnicodeDecodeError, OSError):
            continue
    return "\n".join(parts)


@dataclass(frozen=True)
class MetricFact:
    name: str  # the family's name as exposed (a counter's without `_total`)
    kind: str  # counter, gauge, histogram, info, stateset (prometheus_client's type)
    help: str
    labels: tuple[str, ...]
    #: label -> every value created at start-up; a label absent here takes open values (engine, gpu, version ...).
    values: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def exposed(self) -> str:
        """The name a query uses: `_total` on counters, `_info` on info."""
        return {"counter": self.name + "_total", "info": self.name + "_info"}.get(self.kind, self.name)


#: Labels whose values are not a closed set known in advance.
OPEN_LABELS = frozenset({"engine", "gpu", "version", "method", "path"})


@cache
def metrics() -> tuple[MetricFact, ...]:
    """Every family the proxy registers, with the label values created at start-up (proxy/app.py's arguments)."""
    from proxy.app import _edges
    from proxy.front.route_table import LIFECYCLE_PATHS
    from proxy.lifecycle.states import State
    from proxy.observe.metrics import Metrics

    registry = CollectorRegistry()
    built = Metrics(
        registry,
        version="0",
        engines=["default"],
        states=[s.value for s in State],
        operations=sorted(set(LIFECYCLE_PATHS.values())),
        edges=_edges(),
    )
    declared: dict[str, tuple[str, ...]] = {}
    for collector in vars(built).values():
        name, labelnames = (
            getattr(collector, "_name", getattr(collector, "name", None)),
            getattr(collector, "_labelnames", None),
        )
        if isinstance(name, str) and labelnames is not None:
            declared[name.removesuffix("_total")] = tuple(labelnames)
    found = []
    for family in registry.collect():
        values: dict[str, list[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                if value not in values.setdefault(label, []):
                    values[label].append(value)
        labels = declared.get(family.name) or tuple(label for label in values if label not in ("le", "quantile"))
        if family.type == "stateset":
            labels = (*labels, family.name)
        closed = {label: tuple(values[label]) for label in labels if label in values and label not in OPEN_LABELS}
        found.append(MetricFact(family.name, family.type, family.documentation, tuple(labels), closed))
    return tuple(found)


@cache
def metric_names() -> frozenset[str]:
    """Every name a query may use: the families and their samples' names."""
    names: set[str] = set()
    for fact in metrics():
        names.add(fact.name)
        names.update(fact.name + suffix for suffix in SAMPLE_SUFFIXES)
    return frozenset(names)


@cache
def headers() -> frozenset[str]:
    """Every `X-Lifeguard-*` header name the proxy's sources spell out."""
    found: set[str] = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        found.update(name for name in HEADER_RE.findall(path.read_text()))
    return frozenset(found)


@cache
def reasons() -> dict[str, int]:
    """Every error reason the proxy answers, with its HTTP status (UpstreamRejected: vLLM's own 4xx)."""
    from proxy.errors import LifeguardError

    found: dict[str, int] = {}

    def walk(cls: type[LifeguardError]) -> None:
        found.setdefault(cls.reason, cls.status)
        for sub in cls.__subclasses__():
            walk(sub)

    walk(LifeguardError)
    return found


@cache
def own_routes() -> tuple[str, ...]:
    """The paths the proxy answers itself (besides the lifecycle calls and, with several engines, /v1/models)."""
    from proxy.front import own_answers, status_page

    return (*own_answers._OWN, status_page.PAGE_PATH)


@cache
def settings() -> tuple[str, ...]:
    from proxy.config import Settings

    return tuple(Settings.model_fields)


@cache
def engine_settings() -> tuple[str, ...]:
    from proxy.config import EngineSettings

    return tuple(EngineSettings.model_fields)


@cache
def make_targets() -> tuple[set[str], set[str]]:
    """The Makefile's targets that have a rule, and those it declares .PHONY."""
    text = (ROOT / "Makefile").read_text()
    rules = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.M))
    phony: set[str] = set()
    for line in re.findall(r"^\.PHONY:(.*)$", text, re.M):
        phony.update(line.split())
    return rules, phony


@cache
def log_events() -> frozenset[str]:
    """Every `event` a log record of the proxy carries."""
    found: set[str] = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        found.update(re.findall(r'"event":\s*"(\w+)"', path.read_text()))
    return frozenset(found)


@cache
def serving_causes() -> frozenset[str]:
    """The `cause` of a `/lifeguard/serving` 503 (`not_serving`): why inference would not be forwarded now."""
    from proxy.lifecycle import rules

    source = Path(rules.__file__ or "").read_text()
    found = set(re.findall(r'cause="(\w+)"', source))
    found.update(cause for cause, _ in rules._NOT_SERVING_IN.values())
    return frozenset(found)


#: The source of each command the docs give flags to.
COMMAND_SOURCES: dict[str, tuple[str, ...]] = {
    "vllm-lifeguard serve": ("proxy/cli.py",),
    "vllm-lifeguard sim": ("lifeguard_sim/cli.py",),
    "vllm-lifeguard status": ("proxy/observe/status_cli.py",),
    "vllm-lifeguard check": ("proxy/check/cli.py",),
    # scripts/bench.sh passes every option it does not know to benchmarks/run.py
    "scripts/bench.sh": ("scripts/bench.sh", "benchmarks/run.py"),
}


@cache
def command_source(command: str) -> tuple[Path, ...]:
    """The files that define `command`'s flags: one of COMMAND_SOURCES, a module of the bench run with `-m`
    (`benchmarks.run`), or a script of the repository by name."""
    if command in COMMAND_SOURCES:
        return tuple(ROOT / rel for rel in COMMAND_SOURCES[command])
    if command.startswith("benchmarks."):
        module = ROOT / "benchmarks" / f"{command.removeprefix('benchmarks.')}.py"
        return (module,) if module.exists() else ()
    name = command.rsplit("/", 1)[-1]
    if name == "bench.sh":
        return command_source("scripts/bench.sh")
    return tuple(path for path in code_files() if path.name == name)


@cache
def openapi_paths() -> frozenset[str]:
    """The paths docs/openapi.yaml describes."""
    text = (ROOT / "docs" / "openapi.yaml").read_text()
    paths = text.split("\npaths:\n", 1)[1]
    return frozenset(re.findall(r"^  (/[^:\s]*):", paths, re.M))


#: An indented comment line that is an example of YAML (`#   - name: policy`, `#   routes: {...}`), not prose.
_YAML_EXAMPLE = re.compile(r"^ {3,5}(?:- )?\w+:")


def config_comments() -> dict[str, str]:
    """config/lifeguard.yaml: each top-level key's comment, the lines just above it (after a blank line or a
    `# ---` section line), as one line of prose; indented YAML examples in it are left out."""
    found: dict[str, str] = {}
    block: list[str] = []
    for line in (ROOT / "config" / "lifeguard.yaml").read_text().splitlines():
        if line.startswith("#"):
            text = line[1:]
            if text.strip().startswith("---") or "yaml-language-server:" in text:
                block = []
            elif not (text.startswith("   ") and _YAML_EXAMPLE.match(text)):
                block.append(text.strip())
            continue
        key = re.match(r"^(\w+):", line)
        if key is not None:
            found[key.group(1)] = " ".join(block)
        block = []
    return {key: re.sub(r"\s+", " ", text).strip() for key, text in found.items()}
