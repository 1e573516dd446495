"""The docs name only what exists: every file path, test, setting, environment variable, metric and label value,
route, `X-Lifeguard-*` header, error reason, log event, flag and make target that README.md, CONTRIBUTING.md,
benchmarks/README.md, docs/**/*.md and the comments of config/lifeguard.yaml mention is checked against the code
(scripts/docs/facts.py reads it), and the Grafana dashboard and alert rules query only series and label values the
proxy exports.

A mention of something that no longer exists (in a dated run log, say) is allowed only where the text says so:
`(removed)`, `(renamed ...)` or `(since removed)` right after it. `EXEMPT` lists the few mentions let through
otherwise, each with its reason; no file is exempt as a whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from proxy.front.route_table import RouteTable, build_table
from scripts.docs import facts

ROOT = Path(__file__).resolve().parents[2]


#: (file, mention): why it may name something the code does not have.
EXEMPT: dict[tuple[str, str], str] = {
    ("docs/reliability.md", "weights_asleep"): "'414 `weights_asleep`' there is a count of answers, not a status",
}

#: Right after a mention: the text says it is gone.
GONE_RE = re.compile(r"^[`'\"]?\s*\((?:since )?(?:removed|renamed|gone|deleted)\b")

PATH_RE = re.compile(
    r"(?<![\w./@:~$-])((?:proxy|lifeguard_sim|benchmarks|tests|scripts|docs|deploy|config)/[\w./*-]*[\w*/])(::[\w\[\]-]+)?"
)
MD_LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
BARE_MD_RE = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
METRIC_RE = re.compile(r"(?<![\w/.~-])(lifeguard_[a-z_]+)")
HEADER_RE = re.compile(r"X-Lifeguard-[A-Za-z][A-Za-z-]*[A-Za-z]")
OWN_ROUTE_RE = re.compile(r"(?<![\w/.~-])(/lifeguard/[\w/-]*\w)")
# A request as the docs write one: `POST /sleep`, `GET /engines/policy/lifeguard/state`.
REQUEST_RE = re.compile(r"\b(GET|POST|PUT|DELETE|PATCH|HEAD) (/[\w/{}<>.*-]*[\w}>*])")
ENV_RE = re.compile(r"(?<![\w$])((?:LIFEGUARD|CHAOS|BENCH)_[A-Z0-9_]*[A-Z0-9])\b")
MAKE_RE = re.compile(r"`make ([a-z][\w-]*)")
EVENT_RE = re.compile(r"\bevent=(\w+)")
# A reason as the docs write it: a status then the reason in backticks ("503 `hold_timeout`").
REASON_RE = re.compile(r"(?<![\d,.])\b(400|401|403|404|405|408|409|413|414|431|503) `([a-z][a-z_]+)`")
# A flag given to a command of ours: `vllm-lifeguard serve ... --flag`, `scripts/x.sh --flag` or
# `python -m benchmarks.run --flag` in one code span.
COMMAND_RE = re.compile(r"(vllm-lifeguard (?:serve|sim|status|check)|[\w/.-]+\.(?:py|sh)|benchmarks\.\w+)\b([^`|;]*)")
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# `key: value` of the settings, or a `LIFEGUARD_*` variable, in backticks.
SETTING_RE = re.compile(r"`([a-z][a-z0-9_]*)(?::[^`]*)?`")
SELECTOR_RE = re.compile(r"\b(lifeguard_[a-z_]+)\{([^}]*)\}")
MATCHER_RE = re.compile(r"(\w+)\s*(=~|=|!=|!~)\s*\\?\"([^\"\\]*)\\?\"")
# A table row of a metric: "| `name` | type | `label` (v1, v2) ... |".
ROW_RE = re.compile(r"^\|\s*`(lifeguard_[a-z_]+)`\s*\|([^|]*)\|([^|]*)\|")
LABEL_LIST_RE = re.compile(r"`?(\w+)`? \(([^()]*)\)")

#: Metric-like names that are not metrics: the simulator's package, the test helpers, the status page's cookie.
NOT_METRICS = frozenset({"lifeguard_sim", "lifeguard_testing", "lifeguard_ui", "lifeguard_ui_8080"})
#: Words the settings pattern matches that are not settings (checked as settings only when the line says so).
SETTING_SUFFIXES = ("_s", "_bytes", "_fraction", "_enabled", "_routes", "_dir", "_token", "_file", "_level", "_drift")


def doc_files() -> list[Path]:
    top = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md"]
    return [*top, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "config" / "lifeguard.yaml"]


def doc_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines the lint reads: a Markdown file's, and the YAML file's comments."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if path.suffix == ".yaml":
            if "#" not in line:
                continue
            line = line[line.index("#") :]
        yield number, line


@cache
def _all_md_names() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts)


@cache
def _test_names(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r"^\s*(?:async )?(?:def|class) (\w+)", path.read_text(), re.M))


def _path_exists(text: str) -> bool:
    text = text.rstrip("/")
    if "*" in text:
        return any(ROOT.glob(text))
    return (ROOT / text).exists()


def _gone(line: str, end: int) -> bool:
    return bool(GONE_RE.match(line[end:].lstrip()))


@cache
def _settings() -> frozenset[str]:
    return frozenset(facts.settings()) | frozenset(facts.engine_settings())


@cache
def _env_names() -> frozenset[str]:
    code = facts.code_text()
    from_settings = {"LIFEGUARD_" + name.upper() for name in facts.settings()}
    return frozenset(from_settings | {name for name in facts.ENV_RE.findall(code)})


@cache
def _table() -> RouteTable:
    return build_table()


@cache
def _simulator_text() -> str:
    return "\n".join(path.read_text() for path in sorted((ROOT / "lifeguard_sim").rglob("*.py")))


@cache
def _label_values() -> dict[tuple[str, str], tuple[str, ...]]:
    found: dict[tuple[str, str], tuple[str, ...]] = {}
    for fact in facts.metrics():
        for label, values in fact.values.items():
            for name in {fact.name, fact.exposed, *(fact.name + s for s in facts.SAMPLE_SUFFIXES)}:
                found[(name, label)] = values
    return found


@cache
def _labels() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for fact in facts.metrics():
        for name in {fact.name, fact.exposed, *(fact.name + s for s in facts.SAMPLE_SUFFIXES)}:
            found[name] = fact.labels
    return found


def check_line(rel: str, line: str) -> Iterator[str]:
    """What one line of a doc names that the code does not have."""
    for match in PATH_RE.finditer(line):
        path, test = match.group(1), match.group(2)
        if _gone(line, match.end()):
            continue
        if not _path_exists(path):
            yield f"file {path} does not exist"
        elif test:
            name = test[2:].split("[")[0]
            if path.endswith(".py") and name not in _test_names(ROOT / path):
                yield f"test {path}{test} does not exist"
    for match in MD_LINK_RE.finditer(line):
        target = match.group(1)
        if "://" in target or target.startswith(("mailto:", "#")):
            continue
        base = (ROOT / rel).parent
        if not (base / target).exists() and not _gone(line, match.end()):
            yield f"link {target} does not exist"
    for match in BARE_MD_RE.finditer(line):
        if match.group(1) not in _all_md_names() and not _gone(line, match.end()):
            yield f"file {match.group(1)} is in no folder of the repository"
    metric_names = facts.metric_names()
    for match in METRIC_RE.finditer(line):
        name = match.group(1)
        if name in NOT_METRICS or name.endswith("_") or _gone(line, match.end()):
            continue
        if name not in metric_names:
            yield f"metric {name} is not exported"
    yield from check_selectors(line)
    headers = facts.headers()
    for match in HEADER_RE.finditer(line):
        if match.group(0) not in headers and not _gone(line, match.end()):
            yield f"header {match.group(0)} is not sent or read by the proxy"
    own = set(facts.own_routes())
    for match in OWN_ROUTE_RE.finditer(line):
        route = match.group(1)
        if route not in own and not _gone(line, match.end()):
            yield f"route {route} is not one of the proxy's own ({', '.join(sorted(own))})"
    for match in REQUEST_RE.finditer(line):
        method, path = match.group(1), re.sub(r"^/engines/[^/]+", "", match.group(2)) or "/"
        if path.startswith("/lifeguard") or _gone(line, match.end()):
            continue  # the proxy's own: checked above
        if _table().lookup(method, path) is None and path not in _simulator_text():
            yield f"route {method} {path} is in no route table (vLLM's, a trainer's) nor the simulator's"
    for match in ENV_RE.finditer(line):
        if match.group(1) not in _env_names() and not _gone(line, match.end()):
            yield f"environment variable {match.group(1)} is read nowhere"
    rules, _ = facts.make_targets()
    for match in MAKE_RE.finditer(line):
        if match.group(1) not in rules and not _gone(line, match.end()):
            yield f"make target {match.group(1)} has no rule in the Makefile"
    events = facts.log_events()
    for match in EVENT_RE.finditer(line):
        if match.group(1) not in events:
            yield f"log event {match.group(1)} is logged nowhere"
    if (to_come := re.search(r"(?i)still to come|not yet logged", line)) is not None:
        for name in re.findall(r"`(\w+)`", line[to_come.end() :]):
            if name in events:
                yield f"log event {name} is called still to come, but it is logged"
    reasons = facts.reasons()
    for match in REASON_RE.finditer(line):
        status, reason = int(match.group(1)), match.group(2)
        if reason in facts.serving_causes():
            continue  # /lifeguard/serving's 503 not_serving names its cause
        if reason in reasons:
            if reasons[reason] != status and reason != "upstream_rejected":
                yield f"reason {reason} is answered with {reasons[reason]}, not {status}"
        elif not _gone(line, match.end()):
            yield f"reason {reason} ({status}) is not one the proxy answers"
    for code in re.finditer(r"`([^`]+)`", line):
        if _gone(line, code.end()):
            continue
        for command in COMMAND_RE.finditer(code.group(1)):
            sources = facts.command_source(command.group(1))
            if not sources:
                continue  # a file of vLLM's or a trainer's: its path is checked where it is one of ours
            text = "\n".join(source.read_text() for source in sources)
            for flag in FLAG_RE.findall(command.group(2)):
                if flag not in text and f'"{flag[2:]}"' not in text and flag != "--help":
                    yield f"flag {flag} of {command.group(1)} does not exist"
    for match in SETTING_RE.finditer(line):
        name = match.group(1)
        if (
            name.endswith(SETTING_SUFFIXES)
            and "_" in name
            and name not in _settings()
            and name not in facts.code_text()
        ):
            yield f"setting {name} does not exist"


def check_selectors(text: str) -> Iterator[str]:
    """Label matchers of a PromQL selector of a lifeguard_* series: the label exists, its values are the code's."""
    for match in SELECTOR_RE.finditer(text):
        metric = match.group(1)
        labels = _labels().get(metric)
        if labels is None:
            continue  # an unknown metric is reported by name
        for label, op, value in MATCHER_RE.findall(match.group(2)):
            if label in ("namespace", "pod", "job", "instance", "le", "quantile"):
                continue
            if label not in labels:
                yield f"{metric} has no label {label}"
                continue
            closed = _label_values().get((metric, label))
            if closed is None or "$" in value:
                continue
            wanted = value.split("|") if op in ("=~", "!~") else [value]
            for one in wanted:
                if one and "." not in one and "*" not in one and one not in closed:
                    yield f"{metric}{{{label}}} never takes the value {one!r} (it takes {', '.join(closed)})"


def check_metric_rows(rel: str, text: str) -> Iterator[str]:
    """A metric table's row: the labels it lists exist, and the values listed for a closed label are the code's,
    all of them where the list is only values."""
    for line in text.splitlines():
        row = ROW_RE.match(line)
        if row is None:
            continue
        metric, cell = row.group(1), row.group(3)
        labels = _labels().get(metric)
        if labels is None:
            continue
        for label, listed in LABEL_LIST_RE.findall(cell):
            closed = _label_values().get((metric, label))
            if label not in labels:
                yield f"{rel}: table row {metric}: no label {label}"
                continue
            if closed is None:
                continue
            items = [item.strip().strip("`").strip() for item in listed.split(",")]
            values = [item for item in items if re.fullmatch(r"[A-Za-z_]+", item)]
            for value in values:
                if value not in closed:
                    yield f"{rel}: table row {metric}: {label} never takes the value {value!r}"
            if len(values) == len(items):
                missing = [value for value in closed if value not in values]
                if missing:
                    yield f"{rel}: table row {metric}: {label} values missing: {', '.join(missing)}"


def findings() -> list[str]:
    found: list[str] = []
    for path in doc_files():
        rel = str(path.relative_to(ROOT))
        for number, line in doc_lines(path):
            for finding in check_line(rel, line):
                mention = finding.split(" ")[1]
                if (rel, mention) in EXEMPT:
                    continue
                found.append(f"{rel}:{number}: {finding}")
        if path.suffix == ".md":
            found += check_metric_rows(rel, path.read_text())
    found += completeness()
    found += code_queries()
    found += makefile()
    return found


def completeness() -> Iterator[str]:
    """What the code has that the docs must name: every metric in docs/observability.md's tables, every header,
    reason and own route somewhere."""
    docs = "\n".join(path.read_text() for path in doc_files())
    observability = (ROOT / "docs" / "observability.md").read_text()
    for fact in facts.metrics():
        if not re.search(rf"^\|\s*`{fact.exposed}`", observability, re.M):
            yield f"docs/observability.md: metric {fact.exposed} is in no table"
    for header in sorted(facts.headers()):
        if header not in docs:
            yield f"header {header} is documented nowhere"
    for reason in sorted(facts.reasons()):
        if f"`{reason}`" not in docs:
            yield f"reason {reason} is documented nowhere"
    for route in facts.own_routes():
        if route not in docs:
            yield f"route {route} is documented nowhere"
    documented = facts.openapi_paths()
    from proxy.front.route_table import LIFECYCLE_PATHS

    for route in (*LIFECYCLE_PATHS, *facts.own_routes()):
        if route not in documented:
            yield f"docs/openapi.yaml: route {route} is not described"
    prose = "\n".join(path.read_text() for path in doc_files() if path.suffix == ".md")
    for name in facts.settings():
        if not re.search(rf"\b{name}\b", prose):
            yield f"setting {name} is documented nowhere but in config/lifeguard.yaml"


def code_queries() -> Iterator[str]:
    """The dashboard and the alert rules query series the proxy exports, with label values it sets."""
    for rel in (
        "deploy/grafana/dashboard.py",
        "deploy/prometheus/lifeguard-rules.yaml",
        "deploy/prometheus/lifeguard-rules.test.yaml",
    ):
        text = (ROOT / rel).read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for finding in check_selectors(line.replace("{{", "{").replace("}}", "}")):
                yield f"{rel}:{number}: {finding}"
            for match in METRIC_RE.finditer(line):
                name = match.group(1)
                if name not in facts.metric_names() and name not in NOT_METRICS and not name.endswith("_"):
                    yield f"{rel}:{number}: metric {name} is not exported"


def makefile() -> Iterator[str]:
    rules, phony = facts.make_targets()
    for target in sorted(phony - rules):
        yield f"Makefile: .PHONY target {target} has no rule"


def test_the_docs_name_only_what_the_code_has() -> None:
    found = findings()
    assert not found, f"{len(found)} findings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "finding"),
    [
        ("see `proxy/relays.py`", "file proxy/relays.py does not exist"),
        ("`lifeguard_nope_total`", "metric lifeguard_nope_total is not exported"),
        ("`X-Lifeguard-Nope`", "header X-Lifeguard-Nope is not sent or read by the proxy"),
        ("503 `nope_reason`", "reason nope_reason (503) is not one the proxy answers"),
        ('lifeguard_request_duration_seconds_count{route_class="lifeguard"}', "never takes the value 'lifeguard'"),
        ("`/lifeguard/nope`", "route /lifeguard/nope is not one of the proxy's own"),
        ("`make gpu-check`", "make target gpu-check has no rule"),
        ("then `POST /sleep_now`", "route POST /sleep_now is in no route table"),
        ("`LIFEGUARD_NOPE_S`", "environment variable LIFEGUARD_NOPE_S is read nowhere"),
        (
            "tests/unit/lifecycle/test_gate.py::test_nope",
            "test tests/unit/lifecycle/test_gate.py::test_nope does not exist",
        ),
        ("`benchmarks/nope.py`", "file benchmarks/nope.py does not exist"),
        ("`python -m benchmarks.run --nope`", "flag --nope of benchmarks.run does not exist"),
    ],
)
def test_the_lint_catches_each_kind_of_mention(line: str, finding: str) -> None:
    assert any(finding in one for one in check_line("docs/x.md", line)), list(check_line("docs/x.md", line))


def test_a_mention_marked_removed_passes() -> None:
    assert not list(check_line("docs/x.md", "the old `proxy/seam.py` (removed) did it"))


@pytest.mark.parametrize(
    "line",
    [
        "python3 -m venv ~/lifeguard && ~/lifeguard/bin/pip install .",
        "Prometheus's naming practices (prometheus.io/docs/practices/naming)",
        "| SLEEPING | 200 | 503 `asleep` |",  # /lifeguard/serving's cause, beside its 503 not_serving
        "3,593 `engine_unavailable` answers",
    ],
)
def test_what_only_looks_like_a_mention_passes(line: str) -> None:
    assert not list(check_line("docs/x.md", line))
