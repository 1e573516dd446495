"""The end of `.ci/run`: per group, how many tests ran, passed, failed, skipped and were rerun, from the JUnit XML
and the reruns each pytest run of the group recorded (tests/conftest.py, LIFEGUARD_CI_RECORD); every rerun with
its test and its first failure's reason. Exits non-zero when a group failed, when a group of tests ran none, when
a test skipped in CI and passed in no group, unless its reason is one of ALLOWED_SKIPS (a skip there is a
component CI failed to install, or coverage gone), or when a test some group collected was run by no group (the
collected-*.txt and selected-*.txt that tests/ci_rules.py records: a test no group's paths and markers select never
runs, and no JUnit XML shows it).

Usage: python scripts/ci_summary.py RECORD_DIR
  (RECORD_DIR/NN/{name,kind,rc,*.xml,reruns.jsonl,collected-*.txt,selected-*.txt}, one folder per group)
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# Skips that are no missing component, each with why it cannot run anywhere in CI.
ALLOWED_SKIPS = {
    r"claims its GPU through Dynamic Resource Allocation: Kubernetes >= 1\.32": "the 1.29 schema has no DRA",
    r"^vLLM 0\.32 queues the request": "a scenario of vLLM 0.33's, met by the 0.32 profile and the real 0.32",
    r"^simulator-only check": "the conformance run against the real vLLM; the same check runs on the simulator",
    r"^the checkpoint lifecycle is vLLM 0\.34's": "a scenario of vLLM 0.34's, met by the 0.34 profile (real: 0.32)",
    r"this machine has (NVML|CUDA)": "only on a machine with a GPU",
}


COUNTS = ("ran", "passed", "failed", "skipped", "xfailed")


@dataclass
class Group:
    name: str
    kind: str  # "tests": runs pytest and must run some; "script": no pytest of its own
    rc: int | None  # None: did not run (an earlier group failed)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    skipped: dict[str, str] = field(default_factory=dict)  # test id -> reason
    passed: set[str] = field(default_factory=set)
    reruns: list[dict[str, str]] = field(default_factory=list)
    collected: set[str] = field(default_factory=set)  # pytest node ids, before markers and -k chose
    selected: set[str] = field(default_factory=set)  # those its runs went on to run


def read_group(folder: Path) -> Group:
    rc_file = folder / "rc"
    group = Group((folder / "name").read_text().strip(), (folder / "kind").read_text().strip(),
                  int(rc_file.read_text()) if rc_file.exists() else None)  # fmt: skip
    for xml in sorted(folder.glob("*.xml")):
        # A rerun leaves a second <testcase> of the same test in the file: the last one is its outcome.
        cases = {f"{case.get('classname')}::{case.get('name')}": case for case in ET.parse(xml).iter("testcase")}
        for test, case in cases.items():
            group.counts["ran"] += 1
            skip = case.find("skipped")
            if skip is not None and skip.get("type") == "pytest.xfail":  # a known bug pinned by a strict xfail
                group.counts["xfailed"] += 1
            elif skip is not None:
                group.counts["skipped"] += 1
                group.skipped[test] = skip.get("message") or ""
            elif case.find("failure") is not None or case.find("error") is not None:
                group.counts["failed"] += 1
            else:
                group.counts["passed"] += 1
                group.passed.add(test)
    for kind, ids in (("collected", group.collected), ("selected", group.selected)):
        for listing in folder.glob(f"{kind}-*.txt"):
            ids.update(line for line in listing.read_text().splitlines() if line)
    reruns = folder / "reruns.jsonl"
    if reruns.exists():
        group.reruns = [json.loads(line) for line in reruns.read_text().splitlines() if line.strip()]
    return group


def unselected(groups: list[Group]) -> list[str]:
    """The tests some group collected and no group ran."""
    selected = set().union(*(g.selected for g in groups)) if groups else set()
    return sorted(set().union(*(g.collected for g in groups)) - selected) if groups else []


def allowed(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern in ALLOWED_SKIPS)


def main(record: Path) -> int:
    groups = [read_group(folder) for folder in sorted(p for p in record.iterdir() if (p / "name").exists())]
    # Covered: passed in some group, or skipped there for an allowed reason (a make-test skip that says "run
    # check-deploy.sh" is covered by check-deploy's own skip of the same case for a reason in ALLOWED_SKIPS).
    passed_anywhere = set().union(*(g.passed for g in groups)) if groups else set()
    passed_anywhere |= {test for g in groups for test, reason in g.skipped.items() if allowed(reason)}
    complete = all(g.rc == 0 for g in groups)
    problems: list[str] = []
    print("\n=== summary per group (ran = passed + failed + skipped + xfailed; rerun: run again after a failure)")
    print(f"{'group':<28} {'exit':>5} " + " ".join(f"{name:>7}" for name in (*COUNTS, "rerun")))
    for g in groups:
        c = g.counts
        shown = "-" if g.rc is None else str(g.rc)
        print(f"{g.name:<28} {shown:>5} " + " ".join(f"{n:>7}" for n in (*(c[k] for k in COUNTS), len(g.reruns))))
        if g.rc is None:
            continue
        if g.rc != 0:
            problems.append(f"group '{g.name}' failed (exit {g.rc})")
        if g.kind == "tests" and c["ran"] == 0:
            problems.append(f"group '{g.name}' ran no tests (no JUnit XML recorded)")
        for test, reason in sorted(g.skipped.items()):
            # Judged only on a run that reached its end: a group that failed stopped the ones that would pass it.
            if complete and test not in passed_anywhere and not allowed(reason):
                problems.append(f"group '{g.name}': {test} skipped and passed in no group: {reason}")
    if complete:
        problems.extend(f"{test} is run by no group (collected, and left out by every group's paths and markers)"
                        for test in unselected(groups))  # fmt: skip
    for g in groups:
        for rerun in g.reruns:
            print(f"RERUN in '{g.name}': {rerun['test']}: first failure: {rerun['reason'].splitlines()[0]}")
    for problem in problems:
        print(f"CI FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
