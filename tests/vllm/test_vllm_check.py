"""`vllm-lifeguard check --lifecycle` against the real vLLM-for-CPU 0.32, as scripts/check-matrix.sh runs it for
docs/matrix/: the command as a process, pointed at a lifeguard whose vLLM is reachable, so both columns run. What
vLLM itself gets wrong is what tests/conformance/test_matrix.py says it does on this CPU build; through the lifeguard
no row is red; the JSON validates against the schema in the package; the page is written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest

from proxy.check.report import schema
from tests.conformance.test_matrix import VLLM_CPU_DIFFERS, VLLM_DOES
from tests.vllm.conftest import Proxy, lifeguard_bin

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_the_matrix_on_a_real_vllm_direct_and_through(proxy: Proxy, tmp_path: Path) -> None:
    page = tmp_path / "matrix.html"
    argv = [lifeguard_bin(), "check", proxy.url, "--lifecycle", "--gpu-probe", "none", "--json", "--html", str(page)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr or done.stdout[-2000:]
    doc = json.loads(done.stdout)
    jsonschema.validate(doc, schema())
    assert doc["columns"] == ["direct", "through"]
    assert doc["targets"]["direct"]["vllm_version"].startswith("0.32")
    verdicts = {name: {row["id"]: row["cells"][name]["verdict"] for row in doc["rows"]} for name in doc["columns"]}
    expected = {row: VLLM_CPU_DIFFERS.get(row, does) for row, does in VLLM_DOES.items()}
    expected["memory-follows-sleep"] = "skip"  # no GPU here
    why = {row["id"]: row["cells"]["direct"]["why"] for row in doc["rows"]}
    differ = {
        row: (found, expected.get(row), why[row])
        for row, found in verdicts["direct"].items()
        if found != expected.get(row)
    }
    assert verdicts["direct"] == expected, differ
    reds = {
        row["id"]: row["cells"]["through"]["why"] for row in doc["rows"] if row["cells"]["through"]["verdict"] == "red"
    }
    assert reds == {}
    assert [f["verdict"] for f in doc["deployment"] if f["id"] == "left-as-found"] == ["green"]
    assert "wake-unknown-tag" in page.read_text()
