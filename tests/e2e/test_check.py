"""`vllm-lifeguard check` against the simulator, for each vLLM profile it models: every lie the simulator can be
made to tell is red on vLLM itself and green through the lifeguard; the read-only pass changes nothing; bad input
is one sentence and exit 2; the JSON validates against the schema shipped in the package."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from lifeguard_sim.app import SIM_ENGINE, SimSettings, create_sim_app
from lifeguard_sim.engine import Engine
from proxy.check.cli import main as check_main
from proxy.check.client import Http
from proxy.check.column import Column, eventually
from proxy.check.html import to_html
from proxy.check.report import document, schema, to_markdown
from proxy.check.run import Options, Report, check
from proxy.gpu.readers import NoGpuReader
from tests.e2e.conftest import FAST_SIM, Stack

pytestmark = pytest.mark.timeout(110)

PROFILES = ("0.32", "0.33")
#: A client session's bound, under the tests' own 110 s: a hung call is named by its step, not by pytest.
SESSION_TIMEOUT = aiohttp.ClientTimeout(total=60)
#: Short enough that the matrix runs in seconds here; the command's own window is 2 s.
WINDOW_S = 0.4
#: A stream the simulator makes in under a second (the command's own: STREAM_TOKENS, for vLLM-for-CPU).
SIM_STREAM_TOKENS = 400
#: Each lie the simulator injects without killing its process, and the row that must catch it.
LIES = [
    ("sleep:lie-asleep", "sleep-wake-level-1"),
    ("wake_up:lie-asleep", "sleep-wake-level-1"),
    ("sleep:lie-dead", "sleep-wake-level-1"),
    ("wake_up:lie-dead", "sleep-wake-level-1"),
    ("wake_up:garbage", "sleep-wake-level-1"),
    ("wake_up:lose-lora", "lora-across-wake"),
    ("sleep:lie-memory", "memory-follows-sleep"),
    ("wake_up:lie-memory", "memory-follows-sleep"),
]
#: What vLLM does with no fault armed: the hazards the simulator reproduces as measured or read in vLLM.
NATURAL_REDS = {
    "level-2-wake-without-reload", "repeated-sleep", "request-during-sleep", "wake-unknown-tag", "wake-comma-tags",
    "partial-wake-then-forward", "resume-while-asleep", "wake-lifts-pause", "second-resume",
    "weight-update-while-asleep", "prefix-cache-after-weight-change", "label-after-failed-chunk",
    "relabel-without-change", "spans-across-keep-update",
    "stall-behind-health",  # the row arms the simulator's stall: a router sees /health 200 throughout
}  # fmt: skip


#: Rows of vLLM 0.34's routes: they skip on the profiles run here (the 0.34 matrix: docs/matrix/sim-0.34.md).
BEFORE_034 = {"checkpoint-cycle", "kept-offload-tier"}
#: The lifeguard's stall watch, well inside the row's stall (5 pending windows).
STALL_AFTER_S = 0.3


def sim_settings(version: str, gpu_file: Path) -> SimSettings:
    return SimSettings(**{**FAST_SIM.__dict__, "vllm_version": version, "enable_lora": True, "gpu_file": gpu_file})


@pytest.fixture
def bare_sim(aiohttp_server: Any, tmp_path: Path) -> Callable[[str], Awaitable[TestServer]]:
    """A simulator alone, nothing in front of it (the direct column)."""

    async def start(version: str) -> TestServer:
        server: TestServer = await aiohttp_server(create_sim_app(sim_settings(version, tmp_path / "gpu.json")))
        return server

    return start


def sim_of(server: TestServer) -> Engine:
    engine: Engine = server.app[SIM_ENGINE]
    return engine


def url_of(server: Any) -> str:
    return str(server.make_url("")).rstrip("/")


async def run_check(tmp_path: Path, **given: Any) -> Report:
    """`check --lifecycle` with the simulator's GPU file as its memory, and a LoRA adapter to load."""
    adapter = tmp_path / "sql-lora"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text("{}")
    options = Options(lifecycle=True, gpu_probe=f"file:{tmp_path / 'gpu.json'}", lora=[("sql-lora", str(adapter))],
                      pending_window_s=WINDOW_S, stream_tokens=SIM_STREAM_TOKENS, **given)  # fmt: skip
    return await check(options)


def cell(report: Report, row: str, column: str) -> Any:
    (result,) = [result for result in report.results if result.row.id == row]
    return result.cells[column]


def validate(report: Report) -> dict[str, Any]:
    doc = document(report)
    jsonschema.validate(json.loads(json.dumps(doc)), schema())
    return doc


@pytest.mark.parametrize("version", PROFILES)
@pytest.mark.parametrize(("fault", "row"), LIES)
async def test_each_lie_is_red_on_vllm_itself(
    bare_sim: Any, tmp_path: Path, version: str, fault: str, row: str
) -> None:
    server = await bare_sim(version)
    sim_of(server).set_faults([fault])
    report = await run_check(tmp_path, direct=url_of(server), rows=[row])
    found = cell(report, row, "direct")
    assert found.verdict == "red", found.why
    assert found.steps, "a red verdict comes with the calls it was read from"
    assert report.exit_code == 1
    validate(report)


@pytest.mark.parametrize("version", PROFILES)
@pytest.mark.parametrize(("fault", "row"), LIES)
async def test_each_lie_is_green_through_the_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path, version: str, fault: str, row: str
) -> None:
    stack = await make_stack(sim_settings(version, tmp_path / "gpu.json"))
    stack.faults(fault)
    report = await run_check(tmp_path, through=url_of(stack.client.server), direct_column=False, rows=[row])
    found = cell(report, row, "through")
    assert found.verdict == "green", found.why
    assert any(step["status"] == 503 for step in found.steps), "the client was told by a 503"
    assert report.exit_code == 0
    validate(report)


@pytest.mark.parametrize("version", PROFILES)
async def test_the_whole_matrix_both_columns(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path, version: str
) -> None:
    """A lifeguard URL whose vLLM is reachable: both columns; vLLM's own hazards red, none through."""
    stack = await make_stack(sim_settings(version, tmp_path / "gpu.json"), stall_after_s=STALL_AFTER_S)
    report = await run_check(tmp_path, url=url_of(stack.client.server))
    assert report.columns == ["direct", "through"]
    direct = {result.row.id: result.cells["direct"] for result in report.results}
    through = {result.row.id: result.cells["through"] for result in report.results}
    reds = {row for row, c in direct.items() if c.verdict == "red"}
    assert reds == NATURAL_REDS, {row: f"{direct[row].verdict}: {direct[row].why}" for row in reds ^ NATURAL_REDS}
    assert {row: c.why for row, c in through.items() if c.verdict != "green" and row not in BEFORE_034} == {}
    assert {through[row].verdict for row in BEFORE_034} == {"skip"}
    assert report.exit_code == 0
    settled = [finding for finding in report.deployment if finding["id"] == "left-as-found"]
    assert [finding["verdict"] for finding in settled] == ["green"], settled
    doc = validate(report)
    assert "wake-unknown-tag" in to_markdown(doc)
    page = to_html(doc)
    assert page.count("<details>") == 2 * len(report.results) and "<script" not in page
    # The engine is left as it was found: awake, unpaused, the lifeguard RUNNING.
    state = await stack.state()
    assert (state["state"], stack.sim.is_sleeping, stack.sim.is_paused) == ("RUNNING", False, False)


async def test_the_checkpoint_cycle_is_red_on_vllm_034_itself_and_green_through_the_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    stack = await make_stack(sim_settings("0.34", tmp_path / "gpu.json"))
    report = await run_check(tmp_path, url=url_of(stack.client.server), rows=["checkpoint-cycle"])
    direct, through = cell(report, "checkpoint-cycle", "direct"), cell(report, "checkpoint-cycle", "through")
    assert direct.verdict == "red" and "while prepared was answered 503" in direct.why, direct.why
    assert through.verdict == "green" and "held" in through.why, through.why
    assert (await stack.state())["state"] == "RUNNING"


async def test_a_kept_offload_tier_and_a_stall_are_red_on_vllm_034_itself_and_green_through_the_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    settings = SimSettings(**{**sim_settings("0.34", tmp_path / "gpu.json").__dict__, "kv_connector": True})
    stack = await make_stack(settings, stall_after_s=STALL_AFTER_S)
    rows = ["kept-offload-tier", "stall-behind-health"]
    report = await run_check(tmp_path, url=url_of(stack.client.server), rows=rows)
    direct, through = cell(report, rows[0], "direct"), cell(report, rows[0], "through")
    assert direct.verdict == "red" and "KV the old weights computed" in direct.why, direct.why
    assert through.verdict == "green" and "partitioned" not in through.why, through.why
    direct, through = cell(report, rows[1], "direct"), cell(report, rows[1], "through")
    assert direct.verdict == "red" and "/health answered 200" in direct.why, direct.why
    assert through.verdict == "green" and "503 stalled" in through.why, through.why
    assert (await stack.state())["state"] == "RUNNING"


async def test_the_weight_version_rows_are_red_on_vllm_033_itself_and_green_through_the_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    """vLLM's label is whatever was sent last (issue 51): after a chunk that failed mid-way nothing says the weights
    are partial, a relabel of the same weights is a new version, a reload mid-stream leaves one span."""
    stack = await make_stack(sim_settings("0.33", tmp_path / "gpu.json"))
    rows = ["label-after-failed-chunk", "relabel-without-change", "spans-across-keep-update"]
    report = await run_check(tmp_path, url=url_of(stack.client.server), rows=rows)
    direct = {row: cell(report, row, "direct") for row in rows}
    through = {row: cell(report, row, "through") for row in rows}
    assert {row: c.verdict for row, c in direct.items()} == dict.fromkeys(rows, "red"), direct
    assert "nothing says the weights are partial" in direct["label-after-failed-chunk"].why
    assert "one version for all its tokens" in direct["spans-across-keep-update"].why
    assert {row: c.why for row, c in through.items() if c.verdict != "green"} == {}
    assert "409" in through["label-after-failed-chunk"].why
    assert "X-Lifeguard-Weights-Unchanged: true" in through["relabel-without-change"].why
    assert "split where the reloaded weights began" in through["spans-across-keep-update"].why
    assert stack.sim.state_dict()["weights_partial"] is False, "the row reloaded the weights it broke"
    assert (await stack.state())["state"] == "RUNNING" and report.exit_code == 0


def lifecycle_counters(engine: Engine) -> dict[str, object]:
    state = engine.state_dict()
    counters: dict[str, int] = state["counters"]  # type: ignore[assignment]
    return {"counters": dict(counters), **{k: state[k] for k in ("asleep_tags", "paused", "weight_version")}}


async def test_read_only_changes_nothing_on_vllm(bare_sim: Any, tmp_path: Path) -> None:
    server = await bare_sim("0.32")
    before = lifecycle_counters(sim_of(server))
    report = await check(Options(url=url_of(server)))
    assert report.mode == "read-only" and report.results == []
    target = report.targets["direct"]
    assert (target.kind, target.profile, target.dev_mode, target.sleep_mode) == ("vllm", "0.32", True, True)
    assert lifecycle_counters(sim_of(server)) == before
    validate(report)


async def test_read_only_changes_nothing_through_the_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], tmp_path: Path
) -> None:
    stack = await make_stack()
    before, transitions = lifecycle_counters(stack.sim), len((await stack.state())["transitions"])
    before["counters"].pop("generate", None)  # type: ignore[attr-defined]  # the lifeguard's own canary
    report = await check(Options(url=url_of(stack.client.server)))
    after = lifecycle_counters(stack.sim)
    after["counters"].pop("generate", None)  # type: ignore[attr-defined]
    assert after == before
    state = await stack.state()
    assert (state["state"], len(state["transitions"])) == ("RUNNING", transitions)
    assert report.exit_code == 0 and set(report.targets) == {"direct", "through"}


# ---------------------------------------------------------------- bad input: one sentence, exit 2
async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(check_main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_sentence(err: str) -> str:
    assert "Traceback" not in err and "Error(" not in err and "<" not in err, err
    assert err.count("\n") == 1 and err.startswith("vllm-lifeguard check: "), err
    return err


async def test_an_unreachable_url_is_exit_2_in_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    server = TestServer(web.Application())
    await server.start_server()
    url = url_of(server)
    await server.close()  # nothing listens there now
    code, _, err = await run_cli(capsys, url)
    assert code == 2
    assert f"cannot reach {url}: connection refused" in one_sentence(err)


async def test_a_url_that_is_not_vllm_is_exit_2(aiohttp_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    app = web.Application()

    async def page(_: web.Request) -> web.Response:
        return web.Response(text="<html>nginx</html>", content_type="text/html")

    app.router.add_get("/version", page)
    code, _, err = await run_cli(capsys, url_of(await aiohttp_server(app)))
    assert code == 2
    assert "is not a vLLM" in one_sentence(err.replace("<html>nginx</html>", "html"))


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (500, {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}),
        (503, {"error": {"message": "vLLM is not reachable", "type": "ServiceUnavailableError", "code": 503}}),
    ],
)
async def test_an_is_sleeping_that_fails_is_named_not_taken_for_dev_mode_off(
    aiohttp_server: Any, capsys: pytest.CaptureFixture[str], status: int, body: dict[str, Any]
) -> None:
    """CI rehearsal r10: the check read /is_sleeping through a lifeguard while the engine was busy, got no 200, and
    said vLLM was started without VLLM_SERVER_DEV_MODE=1. Only a 404 means that."""
    app = web.Application()

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app.router.add_get("/version", version)
    app.router.add_get("/is_sleeping", is_sleeping)
    code, _, err = await run_cli(capsys, url_of(await aiohttp_server(app)), "--lifecycle")
    assert code == 2
    assert f"GET /is_sleeping answered {status}" in one_sentence(err) and "run the check again" in err
    assert "DEV_MODE" not in err


async def test_a_lifeguard_without_its_token_explains_the_401(
    make_stack: Callable[..., Awaitable[Stack]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIFEGUARD_ADMIN_TOKEN", raising=False)
    stack = await make_stack(admin_token="s3cret")
    code, _, err = await run_cli(capsys, url_of(stack.client.server))
    assert code == 2
    assert "admin token" in one_sentence(err) and "401" in err
    code, out, _ = await run_cli(capsys, url_of(stack.client.server), "--token", "s3cret", "--json")
    assert code == 0
    doc = json.loads(out)
    jsonschema.validate(doc, schema())
    assert doc["targets"]["through"]["token_enforced"] is True
    # The lifecycle calls carry the token too (a refused one would be a 401, not the unknown tag's 400).
    argv = [url_of(stack.client.server), "--token", "s3cret", "--lifecycle", "--row", "wake-unknown-tag", "--json"]
    code, out, _ = await run_cli(capsys, *argv)
    (row,) = json.loads(out)["rows"]
    assert code == 0 and row["cells"]["through"]["steps"][1]["status"] == 400, row["cells"]["through"]


async def test_lifecycle_on_a_busy_engine_is_refused_unless_forced(
    make_stack: Callable[..., Awaitable[Stack]], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await make_stack()
    assert (await stack.client.post("/sleep", params={"level": "1"})).status == 200
    held = asyncio.ensure_future(stack.completion())
    await stack.wait_held(1)
    code, _, err = await run_cli(capsys, url_of(stack.client.server), "--lifecycle")
    assert code == 2
    assert "busy" in one_sentence(err) and "--force" in err
    assert (await stack.client.post("/wake_up")).status == 200
    assert (await held).status == 200


async def test_the_cli_writes_the_page_and_exits_0_through_a_lifeguard(
    make_stack: Callable[..., Awaitable[Stack]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stack = await make_stack()
    page = tmp_path / "matrix.html"
    argv = [url_of(stack.client.server), "--lifecycle", "--row", "wake-unknown-tag", "--html", str(page)]
    code, out, _ = await run_cli(capsys, *argv)
    assert code == 0
    assert "wake-unknown-tag" in out and "\033[" not in out  # no colour when not a TTY
    assert "POST /wake_up?tags=bogus" in page.read_text()


async def test_an_unknown_row_is_exit_2(capsys: pytest.CaptureFixture[str], make_stack: Any) -> None:
    stack = await make_stack()
    code, _, err = await run_cli(capsys, url_of(stack.client.server), "--lifecycle", "--row", "no-such-row")
    assert code == 2 and "unknown row no-such-row" in one_sentence(err)


async def test_a_row_that_hangs_is_red_not_stuck(bare_sim: Any, tmp_path: Path) -> None:
    """Every wait has a deadline: a wake that never answers is a red row, and the check goes on."""
    server = await bare_sim("0.33")
    sim_of(server).set_faults(["wake_up:hang"])
    report = await run_check(tmp_path, direct=url_of(server), rows=["sleep-wake-level-1"], call_timeout_s=1.0)
    found = cell(report, "sleep-wake-level-1", "direct")
    assert found.verdict == "red", found.why
    assert any(step["failure"] == "no answer within 1 s" for step in found.steps), found.steps


async def test_the_restore_resets_the_prefix_cache_once_another_clients_request_ended(bare_sim: Any) -> None:
    """Behind the direct column the lifeguard sends its own canary to vLLM. The restore after a row that wrote
    weights reloads them and resets the prefix cache: a reset while another request holds blocks answers 200
    {"success": false}, and blocks the row's weights computed stayed cached for the next client (CI, the whole
    matrix on 0.33: the restore's canary read them, and every later row was "not run")."""
    server = await bare_sim("0.33")
    engine = sim_of(server)
    async with aiohttp.ClientSession(timeout=SESSION_TIMEOUT) as session:
        column = await _direct_column(session, server)
        await _a_row_writes_weights(column)
        assert (await column.completion()).status == 200  # a client's request: its blocks, of the row's weights
        other = {"model": column.model, "prompt": "elsewhere", "max_tokens": 300, "ignore_eos": True}
        running = asyncio.ensure_future(column.http.call("POST", "/v1/completions", json_body=other, timeout=20))
        assert await eventually(lambda: _true(engine.scheduler.running == 1), timeout=10), "the request never ran"
        assert await column.restore() is None
        assert engine.scheduler.running == 0 and (await running).status == 200
        assert (await column.completion()).status == 200  # the same request again, after the restore
        assert [v["kind"] for v in engine.violations] == [], "served from blocks the row's weights computed"


async def _true(value: bool) -> bool:
    return value


async def _direct_column(session: aiohttp.ClientSession, server: TestServer) -> Column:
    """The direct column on `server`, its golden canary recorded, as the command starts it."""
    column = Column("direct", Http(session, url_of(server)), False, sim_of(server).settings.model, NoGpuReader())
    column.golden = await column.answer_text()
    return column


async def _a_row_writes_weights(column: Column) -> None:
    for path, body in (("/start_weight_update", {}), ("/update_weights", {"update_info": {}}),
                       ("/finish_weight_update", {})):  # fmt: skip
        assert (await column.call("POST", path, json_body=body)).status == 200


async def test_the_restore_sees_weights_a_row_wrote_behind_the_canarys_cached_prefix(bare_sim: Any) -> None:
    """The canary's prompt fills a prefix-cache block. A row that writes weights leaves that block cached, and an
    unsalted canary read the old weights' KV from it: the restore found the canary as before and left the engine
    serving the row's weights (and `left-as-found` would have said green)."""
    server = await bare_sim("0.33")
    engine = sim_of(server)
    async with aiohttp.ClientSession(timeout=SESSION_TIMEOUT) as session:
        column = await _direct_column(session, server)
        assert (await column.completion()).status == 200  # a client's request: its blocks, of the checkpoint's
        await _a_row_writes_weights(column)
        assert engine.weight_writes == 1
        assert await column.restore() is None
        assert engine.weight_writes == 0, "the restore reloads the checkpoint"
