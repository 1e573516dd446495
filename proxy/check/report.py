"""The report, four ways: the JSON document (`vllm-lifeguard-check/1`, schema in check_report.schema.json), a
terminal table (coloured on a TTY), Markdown, and (proxy/check/html.py) a page. Every form is rendered from
the JSON document, so they cannot disagree."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from .. import __version__
from .run import Report

SCHEMA_ID = "vllm-lifeguard-check/1"
MARKS = {"green": "✔", "red": "✘", "skip": "–", "info": "·"}
_COLOURS = {"green": "\033[32m", "red": "\033[31m", "skip": "\033[2m", "info": "\033[2m"}
_RESET = "\033[0m"
COLUMN_TITLES = {"direct": "vLLM itself", "through": "through the lifeguard"}


def document(report: Report) -> dict[str, Any]:
    """The report as the versioned JSON document."""
    return {
        "schema": SCHEMA_ID,
        "tool_version": __version__,
        "started_at": datetime.fromtimestamp(report.started_at, UTC).isoformat(timespec="seconds"),
        "seconds": round(report.seconds, 2),
        "mode": report.mode,
        "columns": report.columns,
        "judged_column": report.judged_column,
        "targets": {name: target.as_dict() for name, target in report.targets.items()},
        "deployment": report.deployment,
        "rows": [
            {
                "id": result.row.id,
                "title": result.row.title,
                "hazard": result.row.hazard,
                "reference": result.row.reference,
                "group": result.row.group,
                "cells": {name: cell.as_dict() for name, cell in result.cells.items()},
            }
            for result in report.results
        ],
        "summary": {name: report.counts(name) for name in report.columns} | {"exit_code": report.exit_code},
    }


def schema() -> dict[str, Any]:
    text = resources.files("proxy.check").joinpath("check_report.schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _engine_line(doc: dict[str, Any]) -> str:
    parts = []
    for name, target in doc["targets"].items():
        parts.append(f"{COLUMN_TITLES[name]}: {target['url']} ({target['kind']}, vLLM {target['vllm_version']})")
    return "; ".join(parts)


def to_terminal(doc: dict[str, Any], *, colour: bool) -> str:
    def mark(verdict: str) -> str:
        text = f"{MARKS[verdict]} {verdict}"
        return f"{_COLOURS[verdict]}{text}{_RESET}" if colour else text

    lines = [f"vllm-lifeguard check ({doc['mode']}): {_engine_line(doc)}", ""]
    for finding in doc["deployment"]:
        lines.append(
            f"  {mark(finding['verdict']):<{_pad(colour, 9)}} {finding['column']:<8} {finding['id']:<12} "
            f"{finding['why']}"
        )
    if doc["rows"]:
        columns = doc["columns"]
        lines += ["", f"  {'row':<34}" + "".join(f"{name:<{_pad(colour, 10)}}" for name in columns) + "why"]
        for row in doc["rows"]:
            cells = row["cells"]
            marks = "".join(f"{mark(cells[name]['verdict']):<{_pad(colour, 10)}}" for name in columns if name in cells)
            shown = cells.get(doc["judged_column"]) or next(iter(cells.values()))
            lines.append(f"  {row['id']:<34}{marks}{shown['why']}")
    lines += ["", f"{_counts(doc)} · {doc['seconds']} s · exit {doc['summary']['exit_code']}"]
    return "\n".join(lines) + "\n"


def _counts(doc: dict[str, Any]) -> str:
    """Each column's verdicts: its rows' with --lifecycle, else its findings' (a read-only check runs no row)."""
    if doc["mode"] == "lifecycle":
        per_column, said = {name: doc["summary"][name] for name in doc["columns"]}, ""
    else:
        found = doc["deployment"]
        per_column = {
            name: {v: sum(f["column"] == name and f["verdict"] == v for f in found) for v in ("green", "red", "info")}
            for name in doc["columns"]
        }
        said = " (read-only findings; --lifecycle runs the matrix)"
    columns = (f"{COLUMN_TITLES[name]}: " + ", ".join(f"{n} {v}" for v, n in counts.items()) for name, counts in
               per_column.items())  # fmt: skip
    return "; ".join(columns) + said


def _pad(colour: bool, width: int) -> int:
    return width + (len(_COLOURS["green"]) + len(_RESET) if colour else 0)


def to_markdown(doc: dict[str, Any]) -> str:
    columns = doc["columns"]
    out = [
        "# vLLM lifecycle matrix",
        "",
        f"Made by `vllm-lifeguard check` {doc['tool_version']} on {doc['started_at']} in {doc['seconds']} s "
        f"({doc['mode']}). {_engine_line(doc)}.",
        "",
        "A row is **red** where a client would be misled (a 200 that is not true, a hang, a crash), **green** where "
        "it is told the truth, **skip** where this deployment cannot show it.",
        "",
        "## The deployment",
        "",
        "| column | finding | | |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {f['column']} | {f['id']} | {MARKS[f['verdict']]} {f['verdict']} | {_md(f['why'])} |"
        for f in doc["deployment"]
    ]
    if doc["rows"]:
        out += [
            "",
            "## The matrix",
            "",
            "| row | hazard | reference | " + " | ".join(COLUMN_TITLES[name] for name in columns) + " |",
            "|---|---|---|" + "---|" * len(columns),
        ]
        for row in doc["rows"]:
            cells = " | ".join(_md_cell(row["cells"].get(name)) for name in columns)
            out.append(f"| `{row['id']}` | {_md(row['hazard'])} | {_md(row['reference'])} | {cells} |")
    out += ["", f"Summary: {_counts(doc)}; exit code {doc['summary']['exit_code']}.", ""]
    return "\n".join(out)


def _md_cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return ""
    return f"{MARKS[cell['verdict']]} **{cell['verdict']}**: {_md(cell['why'])}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
