"""`--html FILE`: the report as one self-contained page in the status page's style, each cell's evidence (what
was sent, what came back, the engine's state after) a click away; no script and nothing fetched."""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any

from .report import COLUMN_TITLES, MARKS


def to_html(doc: dict[str, Any]) -> str:
    page = resources.files("proxy.check").joinpath("check_page.html").read_text(encoding="utf-8")
    versions = sorted({target["vllm_version"] for target in doc["targets"].values()})
    where = f"vLLM {', '.join(versions)} · {_gpu(doc)} · {doc['started_at']} · {doc['seconds']} s · {doc['mode']}"
    exit_code = doc["summary"]["exit_code"]
    verdict = "every row a client sees is green" if exit_code == 0 else "a client would be misled: see the red rows"
    body = "\n".join([_targets(doc), _deployment(doc), _matrix(doc) if doc["rows"] else ""])
    for key, value in {
        "TITLE": escape(", ".join(t["url"] for t in doc["targets"].values())),
        "WHERE": escape(where),
        "EXIT_CLASS": "ok" if exit_code == 0 else "bad",
        "EXIT": escape(f"exit {exit_code}: {verdict}"),
        "BODY": body,
    }.items():
        page = page.replace("{{" + key + "}}", value)
    return page


def _gpu(doc: dict[str, Any]) -> str:
    for target in doc["targets"].values():
        if target["gpu"].get("available"):
            return f"GPU: {target['gpu'].get('total_bytes', 0) / (1 << 30):.0f} GiB readable"
    reasons = [str(t["gpu"].get("reason")) for t in doc["targets"].values() if t["gpu"].get("reason")]
    return "no GPU seen" + (f" ({reasons[0]})" if reasons else "")


def _badge(verdict: str) -> str:
    return f'<span class="verdict v-{escape(verdict)}">{MARKS[verdict]} {escape(verdict)}</span>'


def _targets(doc: dict[str, Any]) -> str:
    rows = []
    for name, target in doc["targets"].items():
        facts = [
            f"{target['kind']}",
            f"vLLM {target['vllm_version']}",
            f"profile {target['profile'] or 'none'}",
            f"model {target['model']}",
        ]
        if target["lifeguard_state"]:
            facts.append(f"state {target['lifeguard_state']}")
        rows.append(
            f"<tr><td>{escape(COLUMN_TITLES[name])}</td><td><code>{escape(target['url'])}</code></td>"
            f"<td>{' '.join(f'<span class=tag>{escape(f)}</span>' for f in facts)}</td></tr>"
        )
    return (
        '<section><h2>Targets</h2><table class="list"><tr><th>column</th><th>URL</th><th></th></tr>'
        + "".join(rows)
        + "</table></section>"
    )


def _deployment(doc: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{escape(f['column'])}</td><td>{escape(f['id'])}</td><td>{_badge(f['verdict'])}</td>"
        f"<td>{escape(f['why'])}</td></tr>"
        for f in doc["deployment"]
    )
    return (
        '<section><h2>The deployment (read-only)</h2><table class="list"><tr><th>column</th><th>finding</th>'
        f"<th></th><th></th></tr>{rows}</table></section>"
    )


def _matrix(doc: dict[str, Any]) -> str:
    columns = doc["columns"]
    head = "".join(f"<th>{escape(COLUMN_TITLES[name])}</th>" for name in columns)
    rows = []
    for row in doc["rows"]:
        cells = "".join(f"<td>{_cell(row['cells'].get(name))}</td>" for name in columns)
        rows.append(
            f'<tr id="{escape(row["id"])}"><td><b>{escape(row["title"])}</b><br><code class=muted>'
            f"{escape(row['id'])}</code></td><td>{escape(row['hazard'])}<br><span class='muted small'>"
            f"{escape(row['reference'])} · {escape(row['group'])}</span></td>{cells}</tr>"
        )
    return (
        '<section><h2>The lifecycle matrix</h2><p class="muted small">Red: a client would be misled (a 200 that '
        "is not true, a hang, a crash). Green: it is told the truth. Click a verdict for its evidence.</p>"
        f'<table class="list"><tr><th>row</th><th>hazard</th>{head}</tr>{"".join(rows)}</table></section>'
    )


def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return ""
    steps = "".join(
        f"<tr><td><code>{escape(step['sent'])}</code></td><td>{escape(str(step['status'] or step['failure']))}</td>"
        f"<td><code>{escape(step['body'][:300])}</code>{_headers(step['headers'])}</td>"
        f"<td>{step['seconds']:.3f} s</td></tr>"
        for step in cell["steps"]
    )
    state = escape(json.dumps(cell["state_after"], sort_keys=True))
    return (
        f"<details><summary>{_badge(cell['verdict'])}</summary><p class=why>{escape(cell['why'])}</p>"
        f"<table class=evidence><tr><th>sent</th><th>status</th><th>body</th><th></th></tr>{steps}</table>"
        f"<p class=small>state after: <code>{state}</code></p></details>"
        f"<div class='small why'>{escape(cell['why'][:140])}</div>"
    )


def _headers(headers: dict[str, str]) -> str:
    if not headers:
        return ""
    return "<br><span class=muted>" + escape(", ".join(f"{k}: {v}" for k, v in headers.items())) + "</span>"
