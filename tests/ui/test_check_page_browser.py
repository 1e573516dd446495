"""`vllm-lifeguard check --html`'s page in Debian's headless Chromium: the matrix of a whole run (the proxy in front of
the simulator, both columns) renders from the file alone, with nothing fetched and nothing thrown; a click on a
verdict opens its evidence; a screenshot is kept in the artefacts folder (docs/check-page.png is one)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from proxy.check.html import to_html
from proxy.check.report import document
from proxy.check.run import Options, check
from tests.e2e.conftest import Stack
from tests.ui.chromium import chromium


async def test_the_check_page_shows_the_matrix_and_each_cells_evidence_on_click(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path, artifacts: Path
) -> None:
    stack = await make_stack()
    url = str(stack.client.make_url("")).rstrip("/")
    report = await check(Options(url=url, lifecycle=True, gpu_probe="none", pending_window_s=0.5))
    page_file = tmp_path / "matrix.html"
    page_file.write_text(to_html(document(report)))
    async with chromium(tmp_path / "profile", artifacts / "chromium-check-page.log") as page:
        await page.navigate(page_file.as_uri())
        assert str(await page.evaluate("document.title")).startswith("vllm-lifeguard check")
        rows = await page.evaluate("[...document.querySelectorAll('tr[id]')].map(r => r.id)")
        assert rows == [result.row.id for result in report.results]
        reds = await page.evaluate("document.querySelectorAll('.v-red').length")
        assert reds == report.counts("direct")["red"] > 0
        cell = "document.querySelector('tr#wake-unknown-tag details')"
        assert await page.evaluate(f"{cell}.open") is False
        await page.evaluate(f"{cell}.querySelector('summary').click(); true")
        assert await page.evaluate(f"{cell}.open") is True
        evidence = await page.evaluate(f"{cell}.querySelector('table.evidence').innerText")
        assert "POST /wake_up?tags=bogus" in evidence and "200" in evidence
        shown = await page.evaluate(f"{cell}.getBoundingClientRect().height")
        assert shown > 40, json.dumps(shown)
        await page.screenshot(artifacts / "check-page.png")
        assert page.problems == []
