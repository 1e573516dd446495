"""A newcomer's first mistakes, as they meet them: `vllm-lifeguard` run as a process (the console script), each
mistake ending in one sentence that names where it was made and what to do, with the right exit status (2: the
settings, 1: this machine), and never a traceback, a library's repr or pydantic's dump (docs/troubleshooting.md,
"Start-up"). An upstream that cannot be reached is said at WARNING, by URL and reason, where an operator looks.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from proxy.config import Settings
from tests.e2e.test_cli import BIN, free_port, wait_running

#: What a sentence never holds: a traceback, a library's repr, pydantic's dump or its link.
DUMPS = ("Traceback", "object at 0x", "errors.pydantic.dev", "input_value=")
#: Every deadline here is well inside pytest's 120 s.
EXIT_DEADLINE_S = 20.0
TIMEOUT = aiohttp.ClientTimeout(total=10)


def environment(**extra: str) -> dict[str, str]:
    """This run's environment without any setting of the developer's own (the harness's variables stay: a proxy
    must start among them), `serve` on the loop this run tests (`make test`'s second run: asyncio's), and `extra`."""
    settings = {"LIFEGUARD_CONFIG", *(f"LIFEGUARD_{name.upper()}" for name in Settings.model_fields)}
    loop = {"LIFEGUARD_EVENT_LOOP": os.environ.get("LIFEGUARD_TEST_LOOP", "uvloop")}
    return {**{k: v for k, v in os.environ.items() if k.upper() not in settings}, **loop, **extra}


async def run(*argv: str, **env: str) -> tuple[int, str]:
    """`vllm-lifeguard ARGV` to its exit: its status and everything it printed. One that starts instead of refusing
    is killed at the deadline and named."""
    proc = await asyncio.create_subprocess_exec(
        str(BIN), *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=environment(**env)
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), EXIT_DEADLINE_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"vllm-lifeguard {' '.join(argv)} did not exit within {EXIT_DEADLINE_S} s") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def sentence(said: str) -> str:
    """What was printed, asserted to be words: none of a library's dumps."""
    for dump in DUMPS:
        assert dump not in said, said
    return said


def yaml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lifeguard.yaml"
    path.write_text(text)
    return path


# ----- settings: exit 2, the variable, the file and line, or the flag
async def test_a_bad_variable_is_named_with_what_to_do() -> None:
    """Was: `hold_timeout_s  Input should be greater than 0 [type=greater_than, input_value='-1', ...]`."""
    status, said = await run("serve", "--upstream", "http://127.0.0.1:9", LIFEGUARD_HOLD_TIMEOUT_S="-1")
    assert status == 2
    assert sentence(said) == (
        "vllm-lifeguard: invalid settings: LIFEGUARD_HOLD_TIMEOUT_S must be greater than 0: change or unset it\n"
    )


async def test_a_bad_value_in_the_file_is_named_by_file_and_line(tmp_path: Path) -> None:
    config = yaml_file(tmp_path, "upstream: http://127.0.0.1:9\nport: 70000\n")
    status, said = await run("serve", "--config", str(config))
    assert status == 2
    assert f"{config}:2: port must be less than or equal to 65535: change it there" in sentence(said)


async def test_upstream_and_engines_both_set_says_where_each_was_set(tmp_path: Path) -> None:
    """A rule between two settings: pydantic's dump printed the whole input, the admin token's tail included."""
    config = yaml_file(tmp_path, "engines:\n  - name: a\n    upstream: http://127.0.0.1:2\n")
    status, said = await run("serve", "--config", str(config), "--upstream", "http://127.0.0.1:1",
                             LIFEGUARD_ADMIN_TOKEN="probe-token-Zq7Xk2Lm9Np4")  # fmt: skip
    assert status == 2
    assert "set either upstream (one engine) or engines (several), not both" in sentence(said)
    assert f"(upstream from --upstream; engines from {config}:1)" in said
    assert "Zq7Xk2" not in said


async def test_a_json_variable_that_does_not_parse_is_a_sentence() -> None:
    """Was: pydantic-settings' SettingsError, a traceback of 40 lines."""
    status, said = await run("serve", LIFEGUARD_ENGINES="notjson{")
    assert status == 2
    assert sentence(said).startswith(
        "vllm-lifeguard: invalid settings: LIFEGUARD_ENGINES is not valid JSON (Expecting value at line 1, column 1)"
    )


async def test_a_file_that_is_not_yaml_names_its_line_and_column(tmp_path: Path) -> None:
    """Was: yaml's ParserError, a traceback of 69 lines."""
    config = yaml_file(tmp_path, "upstream: http://127.0.0.1:9\nroutes: [\n")
    status, said = await run("serve", "--config", str(config))
    assert status == 2
    assert sentence(said).startswith(f"vllm-lifeguard: invalid settings: {config}:3:1: not valid YAML (")


@pytest.mark.parametrize(
    ("upstream", "said"),
    [
        ("http://", "has no host: give http://HOST:PORT (got 'http://')"),
        ("http://vllm:port", "is not a URL the proxy can connect to: port can't be converted to integer"),
        ("https://vllm:99999", "is not a URL the proxy can connect to: port out of range 0-65535"),
        ("http://[::1", "is not a URL the proxy can connect to: invalid IPv6 URL"),
    ],
)
async def test_an_upstream_url_the_proxy_cannot_connect_to_is_a_setting_error(upstream: str, said: str) -> None:
    """Was: accepted by the settings, then a traceback from yarl (or pydantic's dump of the engine) at start."""
    status, printed = await run("serve", "--upstream", upstream, "--port", "0")
    assert status == 2
    assert (
        sentence(printed)
        == f"vllm-lifeguard: invalid settings: --upstream {said}"
        + ("" if "(got" in said else f" (got {upstream!r})")
        + "\n"
    )


async def test_a_config_file_that_is_not_there_names_who_named_it(tmp_path: Path) -> None:
    status, said = await run("serve", LIFEGUARD_CONFIG=str(tmp_path / "nope.yaml"))
    assert status == 2
    assert f"the config file {tmp_path / 'nope.yaml'} (LIFEGUARD_CONFIG) does not exist" in sentence(said)


async def test_a_misspelled_variable_is_refused_with_the_one_it_meant() -> None:
    """Was: ignored (`LIFEGUARD_HOLD_TIMEOUT=5` started with the default 300 s); the same typo in YAML was refused."""
    status, said = await run("serve", "--upstream", "http://127.0.0.1:9", LIFEGUARD_HOLD_TIMEOUT="5")
    assert status == 2
    assert sentence(said) == (
        "vllm-lifeguard: invalid settings: LIFEGUARD_HOLD_TIMEOUT is not a setting: rename or unset it (did you mean "
        "LIFEGUARD_HOLD_TIMEOUT_S?)\n"
    )


async def test_a_misspelled_key_in_the_file_is_refused_with_the_one_it_meant(tmp_path: Path) -> None:
    config = yaml_file(tmp_path, "upstream: http://127.0.0.1:9\nhold_timeout: 5\n")
    status, said = await run("serve", "--config", str(config))
    assert status == 2
    assert f"{config}:2: hold_timeout is not a setting: remove or rename it (did you mean hold_timeout_s?)" in said


async def test_the_variables_that_are_no_settings_of_serve_still_start_it() -> None:
    """The rule's exceptions (docs/reference/settings.md): the test harness's own and Kubernetes' service links."""
    port = free_port()
    env = {"LIFEGUARD_PORT": str(port), "LIFEGUARD_GPU_PROBE": "none", "LIFEGUARD_TEST_LOOP": "asyncio",
           "LIFEGUARD_VLLM_PYTHON": "/nowhere/python", "LIFEGUARD_SERVICE_HOST": "10.0.0.1",
           "LIFEGUARD_PORT_8080_TCP_ADDR": "10.0.0.1", "LIFEGUARD_DATA_PLANE": "raw"}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(str(BIN), "serve", "--upstream", "sim", env=environment(**env),
                                                stderr=asyncio.subprocess.PIPE)  # fmt: skip
    try:
        await wait_running(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), EXIT_DEADLINE_S)


async def test_an_empty_admin_token_says_to_unset_it() -> None:
    """Was: pydantic's dump of the whole input (`admin_token is set but empty [... input_value={'admin_token': ''`)."""
    status, said = await run("serve", "--upstream", "http://127.0.0.1:9", LIFEGUARD_ADMIN_TOKEN="")
    assert status == 2
    assert sentence(said) == (
        "vllm-lifeguard: invalid settings: LIFEGUARD_ADMIN_TOKEN is set but empty: set a token, or unset it to leave "
        "the admin routes open\n"
    )


# ----- this machine: exit 1, the address, what to do
@asynccontextmanager
async def port_in_use() -> AsyncIterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("command", [["serve", "--upstream", "sim"], ["sim"]], ids=["serve", "sim"])
async def test_a_port_in_use_names_the_address_and_the_command_that_shows_who_holds_it(command: list[str]) -> None:
    """Was: serve `cannot start: [Errno 98] Address already in use` then `Unclosed client session <... object at 0x`;
    sim a traceback of 22 lines."""
    async with port_in_use() as port:
        status, said = await run(*command, "--port", str(port))
    assert status == 1
    assert f"cannot listen on 127.0.0.1:{port}: another process is listening on port {port}" in sentence(said)
    assert f"`ss -ltnp 'sport = :{port}'` shows which" in said and "pick another port with --port" in said
    assert "Unclosed" not in said


async def test_debug_adds_the_traceback_to_the_sentence() -> None:
    async with port_in_use() as port:
        status, said = await run("serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--log-level",
                                 "debug")  # fmt: skip
    assert status == 1
    assert "Traceback" in said and f"cannot listen on 127.0.0.1:{port}" in said


async def test_an_address_this_machine_does_not_have_says_which_to_listen_on() -> None:
    status, said = await run("serve", "--upstream", "http://127.0.0.1:9", "--host", "192.0.2.1", "--port", "0")
    assert status == 1
    assert "cannot listen on 192.0.2.1:0: no interface of this machine has the address 192.0.2.1" in sentence(said)


async def test_a_state_file_whose_directory_is_missing_is_one_sentence(tmp_path: Path) -> None:
    """Was: the proxy started and logged `could not write the state file ...: FileNotFoundError(2, ...)` 12 times in
    2 s, a repr each time."""
    missing = tmp_path / "no-such-dir" / "state.json"
    status, said = await run("serve", "--upstream", "sim", "--port", "0", LIFEGUARD_STATE_FILE=str(missing))
    assert status == 1
    errors = [line for line in sentence(said).splitlines() if " ERROR " in line]
    assert len(errors) == 1, said
    assert f"cannot keep the state file {missing}: its directory {missing.parent} does not exist" in errors[0]


# ----- an upstream that cannot be reached: a WARNING by URL and reason, readiness and the state say the same
@asynccontextmanager
async def serving(upstream: str, **env: str) -> AsyncIterator[tuple[int, asyncio.subprocess.Process]]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "serve", "--upstream", upstream, "--port", str(port), "--gpu-probe", "none",
        stderr=asyncio.subprocess.PIPE, env=environment(LIFEGUARD_RECONCILE_INTERVAL_S="0.2", **env),
    )  # fmt: skip
    try:
        yield port, proc
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), EXIT_DEADLINE_S)


async def line_with(proc: asyncio.subprocess.Process, pattern: str, deadline_s: float = 15.0) -> str:
    """The first line of the proxy's log matching `pattern` (each line read with the time left)."""
    assert proc.stderr is not None
    deadline, seen = time.monotonic() + deadline_s, []
    while time.monotonic() < deadline:
        try:
            line = (await asyncio.wait_for(proc.stderr.readline(), deadline - time.monotonic())).decode()
        except TimeoutError:
            break
        seen.append(line)
        if re.search(pattern, line):
            return sentence(line)
    raise AssertionError(f"no line /{pattern}/ within {deadline_s} s; the log: {''.join(seen)}")


async def said_by_the_proxy(port: int) -> tuple[str, str, str]:
    """What /lifeguard/serving, /lifeguard/readyz and /lifeguard/state say of the engine."""
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(base, timeout=TIMEOUT) as client:
        async with client.get("/lifeguard/serving") as serving_now:
            assert serving_now.status == 503
            refusal = (await serving_now.json())["error"]["message"]
        async with client.get("/lifeguard/readyz") as ready:
            assert ready.status == 503
            reason = (await ready.json())["reason"]
        async with client.get("/lifeguard/state") as state:
            unreachable = (await state.json())["upstream_unreachable"]["message"]
    return refusal, reason, unreachable


async def test_an_upstream_that_refuses_is_a_warning_until_it_answers() -> None:
    """Was: nothing after "listening"; the engine stayed STARTING and requests were held up to 300 s."""
    vllm_port = free_port()
    url = f"http://127.0.0.1:{vllm_port}"
    async with serving(url) as (port, proc):
        warning = await line_with(proc, "WARNING")
        said = f"vLLM at {url} cannot be reached: connection refused by 127.0.0.1:{vllm_port}"
        assert said in warning and "event=upstream_unreachable" in warning
        refusal, reason, unreachable = await said_by_the_proxy(port)
        assert refusal == f"{said}; inference is held until it answers"
        assert reason == unreachable == said
        sim = await asyncio.create_subprocess_exec(str(BIN), "sim", "--port", str(vllm_port),
                                                   stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
        try:
            assert "after" in await line_with(proc, f"INFO .*vLLM at {url} answers again")
            await wait_running(f"http://127.0.0.1:{port}", proc)
        finally:
            sim.terminate()
            await asyncio.wait_for(sim.wait(), EXIT_DEADLINE_S)


async def test_a_name_that_does_not_resolve_is_said_as_dns() -> None:
    async with serving("http://lifeguard-test.invalid:8000") as (_, proc):
        warning = await line_with(proc, "WARNING")
    assert "vLLM at http://lifeguard-test.invalid:8000 cannot be reached: the host of lifeguard-test.invalid:8000 " \
           "could not be resolved (DNS: " in warning  # fmt: skip


async def test_https_to_a_plain_http_vllm_is_said_as_tls() -> None:
    sim_port = free_port()
    sim = await asyncio.create_subprocess_exec(str(BIN), "sim", "--port", str(sim_port),
                                               stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    try:
        await wait_answering(f"http://127.0.0.1:{sim_port}/health")
        async with serving(f"https://127.0.0.1:{sim_port}") as (_, proc):
            warning = await line_with(proc, "WARNING")
    finally:
        sim.terminate()
        await asyncio.wait_for(sim.wait(), EXIT_DEADLINE_S)
    assert f"the TLS handshake with 127.0.0.1:{sim_port} failed (WRONG_VERSION_NUMBER)" in warning, warning
    assert "it answers plain HTTP: use http://" in warning


async def test_an_upstream_that_never_answers_is_said_as_a_timeout() -> None:
    with socket.socket() as silent:  # connections complete in its backlog; nothing ever answers them
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        async with serving(url, LIFEGUARD_CONTROL_CALL_TIMEOUT_S="0.5") as (_, proc):
            warning = await line_with(proc, "WARNING")
    assert f"vLLM at {url} cannot be reached: no answer to GET /health within 0.5 s" in warning


# ----- check: bad input is one sentence, exit 2; refused, DNS and TLS read apart
async def test_check_refuses_a_row_it_does_not_know_lifecycle_or_not() -> None:
    """Was: `check URL --row bogus` without --lifecycle ignored the row (docs/check.md says exit 2)."""
    for argv in (("--row", "bogus"), ("--row", "bogus", "--lifecycle")):
        status, said = await run("check", "http://127.0.0.1:9", *argv)
        assert status == 2
        assert sentence(said).startswith("vllm-lifeguard check: unknown row bogus: the rows are ")
    status, said = await run("check", "http://127.0.0.1:9", "--row", "repeated-sleep")
    assert status == 2
    assert sentence(said) == (
        "vllm-lifeguard check: --row picks rows of the lifecycle matrix: add --lifecycle (it sleeps and wakes the "
        "engine)\n"
    )


async def test_check_says_refused_dns_and_tls_apart() -> None:
    """Was: all three read `connection refused (...)`."""
    sim_port, closed = free_port(), free_port()
    sim = await asyncio.create_subprocess_exec(str(BIN), "sim", "--port", str(sim_port),
                                               stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    try:
        await wait_answering(f"http://127.0.0.1:{sim_port}/health")
        said = {url: await run("check", url) for url in (
            f"http://127.0.0.1:{closed}", "http://lifeguard-test.invalid:8000", f"https://127.0.0.1:{sim_port}"
        )}  # fmt: skip
    finally:
        sim.terminate()
        await asyncio.wait_for(sim.wait(), EXIT_DEADLINE_S)
    (refused, dns, tls) = [sentence(text) for status, text in said.values() if status == 2]
    assert refused.startswith(f"vllm-lifeguard check: cannot reach http://127.0.0.1:{closed}: connection refused by")
    assert "the host of lifeguard-test.invalid:8000 could not be resolved (DNS: " in dns
    assert f"the TLS handshake with 127.0.0.1:{sim_port} failed (WRONG_VERSION_NUMBER)" in tls


async def wait_answering(url: str, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} did not answer within {deadline_s} s")


def test_every_settings_error_this_file_makes_is_listed_in_troubleshooting() -> None:
    """docs/troubleshooting.md's Start-up section is keyed by the first words each of these errors prints."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    start_up = text[text.index("## Start-up") :]
    for first_words in ("invalid settings: LIFEGUARD_", "is not a setting", "not valid YAML", "is not valid JSON",
                        "is set but empty", "not both", "cannot listen on", "another process is listening",
                        "no interface of this machine", "cannot keep the state file", "cannot be reached",
                        "the TLS handshake", "could not be resolved (DNS", "no upstream to guard",
                        "the config file"):  # fmt: skip
        assert first_words in start_up, first_words
