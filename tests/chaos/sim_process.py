"""The simulator as the chaos run starts it: `vllm-lifeguard sim`, plus a journal that outlives the process.

Same parser, settings and app as `vllm-lifeguard sim` (so `crash` and the `lie-dead` watchdog really end
the process with `os._exit(1)`), with one addition: `--journal PATH`, an append-only JSON-lines file. Each
line is written with one unbuffered `os.write` before anything else happens, so a crash a moment later
loses nothing. It records:

* `begin`: a lifecycle operation reached the engine;
* `state`: the engine's true state when the process starts and after every lifecycle operation ends
  (the timeline the chaos run checks every lifecycle 200 against);
* `violation`: each entry of the engine's violation list, at the moment it is appended;
* `fault`: each fault kind that fired, and for which operation;
* `answer`: each generation request's end: its finish reason, its tokens, the weight-version labels that produced them
  (`weight_versions`, vLLM's spans) and the weights that truly did (`weights`, spans of the simulator's own name for
  them); `state` lines say whether the weights were partial and which label was published;
* `die`: the simulated process death, just before the exit;
* with `--gpu-file-engine` (several simulators on one GPU file): `memory`, each write of this engine's use
  to the shared file, with the device's sum it wrote under the file's lock; `oom`, each wake the device
  refused for want of room.

Usage: python tests/chaos/sim_process.py --journal J.jsonl [every `vllm-lifeguard sim` option]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from lifeguard_sim.app import SIM_ENGINE, create_sim_app
from lifeguard_sim.cli import build_parser, settings_from
from lifeguard_sim.engine import Engine
from lifeguard_sim.faults import OPS, Fired

LIFECYCLE_METHODS = tuple(op for op in OPS if op != "generate")


class Journal:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pid = os.getpid()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "ev": event, "pid": self._pid, **fields}, default=str) + "\n"
        os.write(self._fd, line.encode())


def truth(engine: Engine) -> dict[str, Any]:
    """The part of the engine's state the chaos invariants are about."""
    return {
        "executor_tags": sorted(engine.executor_tags),
        "scheduling_asleep": engine.scheduling_asleep,
        "sleep_level": engine.sleep_level,
        "paused": engine.is_paused,
        "is_sleeping": engine.is_sleeping,
        "weight_update_active": engine.weight_update_active,
        "weights_valid": engine.weights_valid,
        "weights_partial": engine.weights_partial,
        "weight_version": engine.weight_version,
        "checkpoint": str(engine.checkpoint.state),
        "dead": engine.dead,
        "garbage": engine.garbage,
    }


class JournaledViolations(list[dict[str, object]]):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self._journal = journal

    def append(self, item: dict[str, object]) -> None:
        self._journal.write("violation", violation=item)
        super().append(item)


def instrument(engine: Engine, journal: Journal) -> None:
    engine.violations = JournaledViolations(journal)
    engine.on_answer = lambda record: journal.write("answer", **record)

    for name in LIFECYCLE_METHODS:
        original: Callable[..., Awaitable[Any]] = getattr(engine, name)

        @functools.wraps(original)
        async def wrapped(*args: Any, __original: Callable[..., Awaitable[Any]] = original, __name: str = name,
                          **kwargs: Any) -> Any:  # fmt: skip
            outcome = "error"
            journal.write("begin", op=__name)
            try:
                result = await __original(*args, **kwargs)
                outcome = "ok"
                return result
            finally:
                journal.write("state", why=f"{__name}:{outcome}", args=[repr(a) for a in args], s=truth(engine))

        setattr(engine, name, wrapped)

    draw = engine.faults.draw

    def journaled_draw(op: str) -> Fired:
        fired = draw(op)
        if fired.kind is not None:
            journal.write("fault", op=op, kind=fired.kind)
        if fired.extra_seconds:
            journal.write("fault", op=op, kind="slow", seconds=fired.extra_seconds)
        return fired

    engine.faults.draw = journaled_draw  # type: ignore[method-assign]

    die = engine.die

    def journaled_die(reason: str) -> None:
        journal.write("die", reason=reason, s={**truth(engine), "dead": True})
        die(reason)

    engine.die = journaled_die  # type: ignore[method-assign]

    shared = engine._shared  # the shared GPU file (--gpu-file-engine), or None
    if shared is not None:
        publish, claim = shared.publish, shared.claim

        def journaled_publish(own: dict[str, Any]) -> int:
            device = publish(own)
            journal.write("memory", own=int(own["used_bytes"]), device=device, total=int(own["total_bytes"]))
            return device

        def journaled_claim(own: dict[str, Any]) -> int | None:
            device = claim(own)
            if device is None:
                journal.write("oom", own_after=int(own["used_bytes"]))
            else:
                journal.write("memory", own=int(own["used_bytes"]), device=device, total=int(own["total_bytes"]))
            return device

        shared.publish = journaled_publish  # type: ignore[method-assign]
        shared.claim = journaled_claim  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    journal_path = None
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--journal":
            journal_path = next(it)
        elif arg.startswith("--journal="):
            journal_path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if journal_path is None:
        print("sim_process.py: --journal PATH is required", file=sys.stderr)
        return 2
    args = build_parser().parse_args(rest)
    settings = settings_from(args)  # crash_exits_process=True, as the CLI
    app = create_sim_app(settings)
    journal = Journal(journal_path)
    engine = app[SIM_ENGINE]
    instrument(engine, journal)

    async def started(_app: web.Application) -> None:
        journal.write("state", why="start", s=truth(engine))

    app.on_startup.append(started)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, shutdown_timeout=2.0, print=None,
                access_log=None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
