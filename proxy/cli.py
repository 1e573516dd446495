"""`vllm-lifeguard serve` (the proxy) and `vllm-lifeguard sim` (the simulator).

`serve` needs an upstream. `--upstream sim` starts the embedded simulator (lifeguard_sim) on a free
loopback port and guards it, so `make run` shows the whole product on a machine without vLLM; a sidecar
whose upstream was forgotten exits 2 instead of reporting ready in front of a fake engine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import get_args

from aiohttp import web

from . import __version__
from .app import Lifeguard
from .compiled import build_said
from .config import SIMULATOR, LogFormat, LogLevel, OnSleeping, Settings, SettingsError, StartupError, load_settings
from .config.sources import CONFIG_VARIABLE
from .config.startup_errors import NO_UPSTREAM, cannot_listen
from .config.urls import url_shown
from .front.listener import listening_sockets
from .observe.logs import configure_logging
from .sharing.gpu_lock import GpuLockSetupError

log = logging.getLogger("lifeguard")
#: `serve` flags that set a setting of another name (`--no-canary`: `canary_enabled: false`); every other flag of
#: `serve` but `--config` sets the setting its destination names (docs/reference/settings.md reads both).
FLAG_SETTINGS: dict[str, str] = {"no_canary": "canary_enabled"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-lifeguard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vllm-lifeguard {__version__} ({build_said()})")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the guarding proxy in front of vLLM")
    serve.add_argument("--config", help="YAML settings file (see config/lifeguard.yaml); env LIFEGUARD_CONFIG")
    serve.add_argument(
        "--upstream", help=f"vLLM base URL, e.g. http://127.0.0.1:8000; {SIMULATOR!r}: the embedded simulator"
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8080)")
    serve.add_argument("--gpu-probe", help="nvml | file:PATH | none (default nvml)")
    serve.add_argument("--log-level", choices=get_args(LogLevel))
    serve.add_argument("--log-format", choices=get_args(LogFormat))
    serve.add_argument("--on-sleeping", choices=get_args(OnSleeping), help="what a request to a sleeping engine gets")
    serve.add_argument("--no-canary", action="store_true", help="skip the canary completion after a wake")
    sub.add_parser("sim", help="run the vLLM simulator (see `vllm-lifeguard sim --help`)", add_help=False)
    sub.add_parser("status", help="a proxy's state as a table (see `vllm-lifeguard status --help`)", add_help=False)
    sub.add_parser("check", help="what a vLLM deployment gets wrong (`vllm-lifeguard check --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["sim"]:
        return simulator(args_list[1:])
    if args_list[:1] == ["status"]:
        from .observe.status_cli import main as status_main

        return status_main(args_list[1:])
    if args_list[:1] == ["check"]:
        from .check.cli import main as check_main

        return check_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    overrides = {
        "upstream": args.upstream,
        "host": args.host,
        "port": args.port,
        "gpu_probe": args.gpu_probe,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "on_sleeping": args.on_sleeping,
        "canary_enabled": False if args.no_canary else None,
    }
    flag_names = {setting: "--" + flag.replace("_", "-") for flag, setting in FLAG_SETTINGS.items()}
    try:
        settings = load_settings(
            args.config or os.environ.get(CONFIG_VARIABLE),
            config_named_by="--config" if args.config else CONFIG_VARIABLE,
            flag_names=flag_names,
            **overrides,
        )
        if settings.upstream is None and not settings.engines:
            raise SettingsError(NO_UPSTREAM)
    except StartupError as exc:
        return said(exc, "vllm-lifeguard")
    configure_logging(settings.log_level, settings.log_format)
    # transitions logs every callback at INFO; aiohttp's access log doubles every line we log ourselves.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if settings.log_level != "debug":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
            runner.run(serve(settings))
    except (StartupError, GpuLockSetupError, OSError) as exc:
        log.debug("the start failed here", exc_info=exc)
        log.error(
            "%s", exc if isinstance(exc, StartupError) else f"cannot start: {exc}", extra={"event": "cannot_start"}
        )
        return 1
    return 0


def said(error: StartupError, prog: str) -> int:
    """`error` on stderr as the command's own words, before any logging is set up; its exit status."""
    first, *rest = error.lines
    print(f"{prog}: {first}", *rest, sep="\n", file=sys.stderr)
    return error.status


def simulator(argv: list[str]) -> int:
    """`vllm-lifeguard sim`: its socket bound here, so a port in use reads as `serve`'s does."""
    from lifeguard_sim import cli as sim_cli

    args = sim_cli.parse(argv)
    try:
        sockets = listening_sockets(args.host, args.port)
    except OSError as exc:
        return said(cannot_listen(args.host, args.port, exc), "vllm-lifeguard sim")
    return sim_cli.serve(args, sockets)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully (held requests 503, streams get a grace period)."""
    sim_runner: web.AppRunner | None = None
    if settings.upstream == SIMULATOR:
        from lifeguard_sim.app import SimSettings, create_sim_app

        sim_runner = web.AppRunner(create_sim_app(SimSettings()), handle_signals=False)
        await sim_runner.setup()
        await web.TCPSite(sim_runner, "127.0.0.1", 0).start()
        port = sim_runner.addresses[0][1]
        settings = settings.model_copy(update={"upstream": f"http://127.0.0.1:{port}"})
        log.warning("guarding the embedded vLLM simulator at %s, not a vLLM (--upstream sim)", settings.upstream)
    lifeguard = Lifeguard(settings)
    try:
        await _serve(settings, lifeguard)
    finally:
        await lifeguard.close()
        if sim_runner is not None:
            await sim_runner.cleanup()


async def _serve(settings: Settings, lifeguard: Lifeguard) -> None:
    await lifeguard.start(settings.host, settings.port)
    # What start-up made lives as long as the process: kept out of the collector's full passes, which scanned it
    # all each time (~35k objects, ~50 ms a pass during a burst of new streams; docs/performance.md).
    gc.freeze()
    log.info(
        "vllm-lifeguard %s listening on http://%s:%s, guarding %s (event loop: %s, %s)",
        __version__,
        settings.host,
        lifeguard.port,
        settings.upstream_shown or ", ".join(f"{e.name} at {url_shown(e.upstream)}" for e in settings.engines),
        type(asyncio.get_running_loop()).__module__.split(".")[0],
        build_said(),
    )
    if settings.admin_token is None and not loopback_only(settings.host):
        # vLLM's dev-mode routes have no auth; a newcomer's `--host 0.0.0.0` opens them to the network (issue 41).
        log.warning(
            "listening on %s with no admin_token: anyone who reaches this port can sleep, wake, pause the engine and "
            "replace its weights; set LIFEGUARD_ADMIN_TOKEN or restrict who reaches the port (docs/security.md)",
            settings.host,
            extra={"event": "no_admin_token"},
        )
    await _until_signalled()
    log.info("shutting down", extra={"event": "shutdown"})


def loopback_only(host: str) -> bool:
    """True when `host` (the listen address) takes connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop `serve` runs on (setting `event_loop`): uvloop, a dependency, unless it is not installed (a
    hand-made environment), which is said, not fatal."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("event_loop is uvloop but uvloop is not installed: serving on asyncio's own loop",
                        extra={"event": "event_loop_fallback"})  # fmt: skip
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
