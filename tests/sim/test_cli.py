"""``vllm-lifeguard sim``: its --help, and the real process serving and crashing."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from lifeguard_sim.cli import build_parser, main
from lifeguard_sim.faults import KINDS, OPS

LAUNCH = "import sys; from lifeguard_sim.cli import main; sys.exit(main(sys.argv[1:]))"


def test_help_documents_every_fault_kind_op_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in (*KINDS, *OPS):
        assert name in text
    for flag in (
        "--host",
        "--port",
        "--model",
        "--sleep-seconds",
        "--wake-seconds",
        "--token-seconds",
        "--fault",
        "--gpu-file",
        "--weights-gib",
        "--kv-gib",
        "--seed",
        "--no-sleep-mode",
        "--vllm-version",
        "--data-parallel-rank",
        "--no-dev-mode",
        "--checkpoint-prepare-on-startup",
        "--kv-connector",
        "--enable-fault-tolerance",
        "--ft-recovery-seconds",
    ):
        assert flag in text


def test_a_bad_fault_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--fault", "wake_up:melt"])
    assert exit_info.value.code == 2
    assert "wake_up:melt" in capsys.readouterr().err


def test_the_version_flag_defaults_to_the_newest_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lifeguard_sim.cli import settings_from

    assert settings_from(build_parser().parse_args([])).vllm_version == "0.33"
    assert settings_from(build_parser().parse_args(["--vllm-version", "0.32"])).vllm_version == "0.32"
    assert settings_from(build_parser().parse_args(["--vllm-version", "0.34"])).vllm_version == "0.34"
    with pytest.raises(SystemExit) as exit_info:
        main(["--vllm-version", "0.31"])
    assert exit_info.value.code == 2
    assert "0.31" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--checkpoint-prepare-on-startup"],
        ["--vllm-version", "0.34", "--checkpoint-prepare-on-startup", "--no-sleep-mode"],
        ["--enable-fault-tolerance"],
    ],
)
def test_flags_no_vllm_could_start_with_are_a_usage_error(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert "vLLM" in capsys.readouterr().err


def test_the_034_flags_become_settings() -> None:
    from lifeguard_sim.cli import settings_from

    flags = ["--vllm-version", "0.34", "--no-dev-mode", "--checkpoint-prepare-on-startup", "--kv-connector"]
    settings = settings_from(
        build_parser().parse_args([*flags, "--enable-fault-tolerance", "--ft-recovery-seconds", "9"])
    )
    assert (settings.dev_mode, settings.checkpoint_prepare_on_startup, settings.kv_connector) == (False, True, True)
    assert (settings.enable_fault_tolerance, settings.ft_recovery_seconds) == (True, 9.0)


def test_flags_become_settings() -> None:
    from lifeguard_sim.cli import settings_from

    args = build_parser().parse_args(["--fault", "sleep:hang", "--fault", "wake_up:crash@2", "--kv-gib", "8"])
    settings = settings_from(args)
    assert settings.faults == ("sleep:hang", "wake_up:crash@2")
    assert (settings.kv_gib, settings.crash_exits_process) == (8, True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(url: str, method: str = "GET") -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as resp:
        return int(resp.status)


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the simulator exited during start-up"
        try:
            if _request(base + "/health") == 200:
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the simulator did not become healthy in time")


@pytest.fixture
def launch() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _start(procs: list[subprocess.Popen[bytes]], *flags: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(base, proc)
    return base, proc


def test_the_cli_serves_health(launch: list[subprocess.Popen[bytes]]) -> None:
    base, _proc = _start(launch)
    assert _request(base + "/health") == 200


def test_a_crash_fault_exits_the_process_non_zero(launch: list[subprocess.Popen[bytes]]) -> None:
    base, proc = _start(launch, "--fault", "sleep:crash", "--sleep-seconds", "0.01")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _request(base + "/sleep", method="POST")
    assert proc.wait(timeout=10) == 1
