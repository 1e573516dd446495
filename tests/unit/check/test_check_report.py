"""proxy/check's pure parts: the report's forms from one document (hostile text escaped on the page, colour only
when asked), the JSON against its schema, the serving agreement, the exit status and the version profiles."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from proxy.check.client import Reply
from proxy.check.html import to_html
from proxy.check.matrix import ROWS, select
from proxy.check.report import document, schema, to_markdown, to_terminal
from proxy.check.run import Cell, Report, Result
from proxy.check.target import Target, metric_sum, profile_of, serving_agreement

HOSTILE = '<script>alert("x")</script> | `'


def target(kind: str = "lifeguard") -> Target:
    return Target(url="http://127.0.0.1:8080", kind=kind, vllm_version="0.32.0", profile="0.32", model="tiny",
                  dev_mode=True, sleep_mode=True, gpu={"available": False, "reason": None})  # fmt: skip


def report(through_verdict: str) -> Report:
    step = Reply("POST", "/wake_up?tags=bogus", 200, None, HOSTILE, {"X-Lifeguard-Noop": "true"}, 0.01).evidence()
    cells = {
        "direct": Cell("red", f"vLLM said {HOSTILE}", 0.1, [step], {"is_sleeping": True}),
        "through": Cell(through_verdict, "refused", 0.1, [step], {"lifeguard": "SLEEPING"}),
    }
    targets = {"direct": target("vllm"), "through": target()}
    return Report("lifecycle", targets, [], [Result(ROWS[0], cells)], time.time(), 1.5)


@pytest.mark.parametrize(("verdict", "code"), [("green", 0), ("skip", 0), ("red", 1)])
def test_the_exit_status_follows_the_column_a_client_uses(verdict: str, code: int) -> None:
    assert report(verdict).exit_code == code


def test_a_red_deployment_finding_of_the_judged_column_fails_the_check() -> None:
    failing = report("green")
    failing.deployment.append({"column": "through", "id": "serving", "verdict": "red", "why": "disagrees"})
    assert failing.exit_code == 1
    failing.deployment[-1]["column"] = "direct"  # vLLM's own findings are facts, not the lifeguard's failings
    assert failing.exit_code == 0


def test_the_document_validates_and_every_form_shows_the_rows() -> None:
    doc = json.loads(json.dumps(document(report("green"))))
    jsonschema.validate(doc, schema())
    assert doc["summary"] == {"direct": {"green": 0, "red": 1, "skip": 0},
                              "through": {"green": 1, "red": 0, "skip": 0}, "exit_code": 0}  # fmt: skip
    assert ROWS[0].id in to_markdown(doc) and ROWS[0].id in to_terminal(doc, colour=False)
    assert "\033[31m" in to_terminal(doc, colour=True) and "\033[" not in to_terminal(doc, colour=False)


def test_the_schema_refuses_a_document_of_another_shape() -> None:
    doc = json.loads(json.dumps(document(report("green"))))
    doc["rows"][0]["cells"]["through"]["verdict"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema())


def test_the_page_escapes_what_the_engine_answered() -> None:
    page = to_html(document(report("green")))
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "X-Lifeguard-Noop: true" in page


def test_a_pipe_in_an_answer_does_not_break_the_markdown_table() -> None:
    text = to_markdown(document(report("green")))
    row = next(line for line in text.splitlines() if line.startswith(f"| `{ROWS[0].id}`"))
    assert row.count(" | ") == 4  # five cells: row, hazard, reference, two columns


@pytest.mark.parametrize(
    ("state", "status", "body", "agrees"),
    [
        ("RUNNING", 200, {"serving": True}, True),
        ("SLEEPING", 200, {"serving": True}, False),
        ("SLEEPING", 503, {"error": {"cause": "sleeping"}}, True),
        ("RUNNING", 503, {"error": {"message": "no cause"}}, False),
    ],
)
def test_serving_must_agree_with_the_state(state: str, status: int, body: object, agrees: bool) -> None:
    reply = Reply("GET", "/lifeguard/serving", status, body, json.dumps(body))
    assert serving_agreement(state, reply)["agrees"] is agrees


def test_profiles_metrics_and_row_selection() -> None:
    assert [profile_of(v) for v in ("0.32.0", "0.33.1", "0.34.0")] == ["0.32", "0.33", None]
    text = 'vllm:num_requests_running{model_name="tiny"} 2.0\nvllm:num_requests_running_x 9\n'
    assert metric_sum(text, "vllm:num_requests_running") == 2.0
    assert [row.id for row in select(["second-resume"])] == ["second-resume"]
    with pytest.raises(ValueError, match="unknown row nope"):
        select(["nope"])
    assert len({row.id for row in ROWS}) == len(ROWS)


def test_a_read_only_summary_counts_the_findings_it_shows() -> None:
    """Was: `through the lifeguard: 0 green, 0 red, 0 skip` under a list of green findings (no row runs read-only)."""
    targets = {"direct": target("vllm"), "through": target()}
    found = [("direct", "dev-mode", "green"), ("through", "dev-mode", "green"), ("through", "serving", "green"),
             ("through", "admin-token", "info")]  # fmt: skip
    findings = [{"column": column, "id": id, "verdict": verdict, "why": "x"} for column, id, verdict in found]
    doc = json.loads(json.dumps(document(Report("read-only", targets, findings, [], time.time(), 0.1))))
    jsonschema.validate(doc, schema())
    for shown in (to_terminal(doc, colour=False), to_markdown(doc)):
        assert "vLLM itself: 1 green, 0 red, 0 info; through the lifeguard: 2 green, 0 red, 1 info" in shown, shown
        assert "read-only findings; --lifecycle runs the matrix" in shown
