"""The rows of `vllm-lifeguard check --lifecycle` (proxy/check/matrix.py), each run against the engine itself as the
command runs them: what vLLM does with each hazard. One library for both: a row added to the command runs here too,
and fails until this file says what vLLM does with it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from proxy.check.client import Http
from proxy.check.column import STREAM_TOKENS, Column
from proxy.check.matrix import ROWS, Row
from proxy.check.run import load_adapters, run_row
from proxy.check.scenarios import RED, SKIP
from proxy.gpu.readers import NoGpuReader
from tests.conformance.api import VllmApi
from tests.conformance.conftest import MODEL, REAL_ENGINE_URL

GREEN = "green"
#: What vLLM does (red: a client is misled), as the simulator's profiles reproduce it. The simulator's memory is
#: not read here (no GPU file): the physical row skips.
VLLM_DOES = {
    "sleep-wake-level-0": GREEN,
    "sleep-wake-level-1": GREEN,
    "sleep-wake-level-2": GREEN,
    "level-2-wake-without-reload": RED,
    "repeated-sleep": RED,
    "request-during-sleep": RED,
    "wake-unknown-tag": RED,
    "wake-comma-tags": RED,
    "partial-wake-then-forward": RED,
    "resume-while-asleep": RED,
    "wake-lifts-pause": RED,
    "pause-abort": GREEN,
    "pause-wait": GREEN,
    "pause-keep": GREEN,
    "second-resume": RED,
    "update-before-start": GREEN,
    "finish-before-start": GREEN,
    "start-twice": GREEN,
    "weight-update-in-order": GREEN,
    "weight-update-while-asleep": RED,
    "prefix-cache-after-weight-change": RED,
    "lora-across-wake": GREEN,
    "memory-follows-sleep": SKIP,
    "label-after-failed-chunk": RED,
    "relabel-without-change": RED,
    "spans-across-keep-update": RED,
    "checkpoint-cycle": SKIP,  # vLLM 0.34's; the profiles run here are 0.32 and 0.33 (docs/matrix/sim-0.34.md)
    "kept-offload-tier": SKIP,  # vLLM 0.34's reset_connector, as checkpoint-cycle
    "stall-behind-health": RED,  # the row arms the simulator's stall fault
}
#: Where the real vLLM-for-CPU 0.32 differs (docs/matrix/): on CPU a level-2 sleep discards nothing, no weight
#: transfer is configured (no session starts, so no chunk can fail), and the suite's server serves no LoRA.
VLLM_CPU_DIFFERS = {
    "level-2-wake-without-reload": GREEN,
    "start-twice": SKIP,
    "weight-update-in-order": SKIP,
    "weight-update-while-asleep": GREEN,
    "lora-across-wake": SKIP,
    "checkpoint-cycle": SKIP,
    "kept-offload-tier": SKIP,
    "stall-behind-health": SKIP,  # no stall can be made from outside a real vLLM
    "label-after-failed-chunk": SKIP,
}
#: Short here; the command waits 2 s before it calls a request hung.
WINDOW_S = 0.5
#: The simulator makes this stream in under a second; vLLM-for-CPU gets the command's own.
SIM_STREAM_TOKENS = 400


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
async def test_a_row_of_the_check_on_vllm_itself(
    session: aiohttp.ClientSession, engine_url: str, vllm: VllmApi, tmp_path: Path, row: Row
) -> None:
    expected = (VLLM_CPU_DIFFERS if REAL_ENGINE_URL else {}).get(row.id, VLLM_DOES.get(row.id))
    assert expected is not None, f"a new row of the check: say in VLLM_DOES what vLLM does with {row.id}"
    column = Column(
        "direct",
        Http(session, engine_url),
        False,
        MODEL,
        NoGpuReader(),
        pending_window_s=WINDOW_S,
        stream_tokens=STREAM_TOKENS if REAL_ENGINE_URL else SIM_STREAM_TOKENS,
    )
    column.golden = await column.answer_text()
    if not REAL_ENGINE_URL:
        adapter = tmp_path / "check-lora"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text("{}")
        assert await load_adapters(column, [("check-lora", str(adapter))]) is None
    finding = await run_row(row, column)
    assert finding.verdict == expected, finding.why
    assert await column.restore() is None, "the row left the engine as it found it"
