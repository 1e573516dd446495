"""`vllm-lifeguard status [URL]`: the proxy's `/lifeguard/state` as a compact table, for a shell on the node.

One line per engine (state, how long, sleep level and tags asleep, pause, stale weights, held and in-flight
requests, the last verification), the GPUs and the swap queue when several engines share them, the last few
transitions and errors. `--watch` redraws it until Ctrl-C. It reads both shapes of the state (several engines
under `"engines"`, or one engine's flat snapshot). Exit status: 0 shown, 1 the state could not be read, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from .admin_token import client_admin_token

GIB = 1 << 30


class StatusError(Exception):
    """The state could not be read; the message says why and what to do."""


def engines_in(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every engine's snapshot by name, whichever shape the state has."""
    engines = state.get("engines")
    if isinstance(engines, dict):
        return engines
    return {"default": state}


def state_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/lifeguard/state") else base + "/lifeguard/state"


def fetch_state(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    target = state_url(url)
    headers = {"Accept": "application/json"}
    if token:
        headers["X-Lifeguard-Token"] = token
    # The proxy on this node, not through whatever HTTP proxy the environment names.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(target, headers=headers), timeout=timeout) as response:
            body = response.read(64 << 20)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            hint = "set LIFEGUARD_ADMIN_TOKEN or use --token-file"
            raise StatusError(f"{target} needs the admin token: {hint}") from None
        if exc.code == 403:
            raise StatusError(f"{target} refused the admin token (403): it is not this proxy's") from None
        raise StatusError(f"{target} answered {exc.code}: {_error_message(exc.read(65536))}") from None
    except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise StatusError(f"cannot reach {target}: {reason}") from None
    except UnicodeEncodeError:
        raise StatusError("the admin token must be Latin-1 text to go in a header") from None
    try:
        state = json.loads(body)
    except ValueError:
        raise StatusError(f"{target} did not answer JSON: is it a vllm-lifeguard proxy?") from None
    if not isinstance(state, dict) or not ("state" in state or isinstance(state.get("engines"), dict)):
        raise StatusError(f"{target} did not answer a lifeguard state: is it a vllm-lifeguard proxy?")
    return state


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace") or "(no body)"


# ----- the table
def _clock(at: float, *, millis: bool = False) -> str:
    text = time.strftime("%H:%M:%S", time.localtime(at))
    return f"{text}.{int(at * 1000) % 1000:03d}" if millis else text


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _sleep(engine: dict[str, Any]) -> str:
    if engine.get("sleep_level") is None and not engine.get("asleep_tags"):
        return "-"
    level = engine.get("sleep_level")
    parts = [f"L{level}" if level is not None else "L?"]
    if engine.get("asleep_tags"):
        parts.append(",".join(engine["asleep_tags"]))
    if engine.get("sleep_unconfirmed"):
        parts.append("(unconfirmed)")
    return " ".join(parts)


def _weights(engine: dict[str, Any]) -> str:
    text = f"stale:{engine.get('weights_stale_reason') or '?'}" if engine.get("weights_stale") else "ok"
    if (engine.get("prefix_cache") or {}).get("partitioned"):
        text += " +prefix-salted"
    return text + (" +update" if engine.get("weight_update_active") else "")


def _verification(verdict: dict[str, Any] | None) -> str:
    if not verdict:
        return "-"
    checks = verdict.get("checks") or []
    if verdict.get("passed"):
        text = f"ok {_clock(verdict['at'])}"
        missing = [c["name"] for c in checks if c.get("result") == "unavailable"]
        return text + (f" (n/a: {','.join(missing)})" if missing else "")
    failed = [f"{c['name']}: {c.get('detail', '')}" for c in checks if c.get("result") == "fail"]
    return f"FAILED {_clock(verdict['at'])} " + "; ".join(failed)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _node_lock_holder(lock: dict[str, Any] | None) -> str | None:
    """Who holds a GPU's node lock (gpu_lock_dir) when it is a lifeguard of another pod; this proxy's own holds
    are its running swap-queue turns."""
    if not lock or not lock.get("held") or lock.get("held_here"):
        return None
    holder = lock.get("holder")
    return f"{holder['engine']} ({holder['op']}) on {holder['host']}" if holder else "another process on the node"


def _gpu_lines(state: dict[str, Any], engines: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    gpus = state.get("gpus")
    if isinstance(gpus, dict):
        running = [t for t in state.get("swap_queue") or [] if t.get("running")]
        node = (state.get("gpu_lock") or {}).get("gpus") or {}
        for index, gpu in gpus.items():
            if gpu.get("total_bytes"):
                text = f"GPU {index}  {_gib(gpu['used_bytes'])}/{_gib(gpu['total_bytes'])} GiB used"
            else:
                text = f"GPU {index}  no reading ({state.get('gpu_reading') or 'unknown'})"
            text += f"  awake: {', '.join(gpu.get('awake') or []) or '-'}"
            holders = [f"{t['engine']} ({t['op']})" for t in running if str(index) in map(str, t.get("gpus", []))]
            if (other := _node_lock_holder(node.get(str(index)))) is not None:
                holders.append(other)
            if holders:
                text += f"  lock: {', '.join(holders)}"
            lines.append(text)
        return lines
    for name, engine in engines.items():
        memory = engine.get("gpu_memory")
        if not memory:
            continue
        if not memory.get("available"):
            lines.append(f"GPU  no reading for {name} ({memory.get('unavailable_reason')})")
            continue
        for device in memory.get("devices") or []:
            name = str(device["gpu"])  # an index, or a UUID
            label = f"GPU {name}" if name.isdigit() else name
            lines.append(f"{label}  {_gib(device['used_bytes'])}/{_gib(device['total_bytes'])} GiB used")
    return lines


def render(state: dict[str, Any], *, transitions: int = 5) -> str:
    """The whole report for one reading of the state."""
    engines = engines_in(state)
    now = max((float(e.get("read_at") or 0) for e in engines.values()), default=0.0) or time.time()
    rows = [["ENGINE", "STATE", "FOR", "SLEEP", "PAUSED", "WEIGHTS", "HELD", "IN FLIGHT", "LAST VERIFICATION"]]
    for name, engine in engines.items():
        rows.append(
            [
                name,
                str(engine.get("state")),
                _duration(now - float(engine.get("since") or now)),
                _sleep(engine),
                (engine.get("pause_mode") or "yes") if engine.get("paused") else "-",
                _weights(engine),
                str(engine.get("held_requests", 0)),
                str(engine.get("inflight_requests", 0)),
                _verification(engine.get("last_verification")),
            ]
        )
    lines = _table(rows)
    lines += _gpu_lines(state, engines)
    queue = state.get("swap_queue")
    if isinstance(queue, list):
        turns = [
            f"{t['engine']} {t['op']} on GPU {','.join(map(str, t.get('gpus', [])))} "
            f"({'holds its GPUs' if t.get('running') else 'waiting'}, {_duration(float(t.get('for_s', 0)))})"
            for t in queue
        ]
        lines.append("swap queue: " + ("; ".join(turns) if turns else "empty"))
    recent = sorted(
        ((t["at"], name, t) for name, e in engines.items() for t in e.get("transitions") or []), key=lambda x: x[0]
    )[-transitions:] if transitions > 0 else []  # fmt: skip
    if recent:
        lines.append("recent transitions:")
        lines += [f"  {_clock(at, millis=True)}  {name}  {t['from']} -> {t['to']}" for at, name, t in recent]
    errors = sorted(
        ((e["last_error"]["at"], name, e["last_error"]) for name, e in engines.items() if e.get("last_error")),
        key=lambda x: x[0],
    )[-3:]
    if errors:
        lines.append("last errors:")
        lines += [f"  {_clock(at)}  {name}  {err['reason']}: {err['message']}" for at, name, err in errors]
    return "\n".join(lines)


# ----- the command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-lifeguard status", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "url",
        nargs="?",
        help="the proxy's base URL (default http://127.0.0.1:$LIFEGUARD_PORT, else :8080); "
        "http://HOST:PORT/engines/NAME for one engine of several",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token-file", help="read the admin token from this file (default: $LIFEGUARD_ADMIN_TOKEN)")
    token.add_argument("--token", help="the admin token (shows in `ps`: prefer $LIFEGUARD_ADMIN_TOKEN or --token-file)")
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two --watch frames (default 1)")
    parser.add_argument("--transitions", type=int, default=5, help="recent transitions listed (default 5)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the proxy (default 5)")
    return parser


def main(argv: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    url = args.url or f"http://127.0.0.1:{os.environ.get('LIFEGUARD_PORT') or 8080}"
    if not url.startswith(("http://", "https://")):
        parser.error(f"the URL must start with http:// or https://, not {url!r}")
    if not (args.interval > 0 and args.timeout > 0):
        parser.error("--interval and --timeout need a positive number of seconds")
    try:
        token = client_admin_token(args.token, args.token_file)
    except OSError as exc:
        parser.error(f"cannot read --token-file: {exc}")
    if not args.watch:
        try:
            out.write(render(fetch_state(url, token, args.timeout), transitions=args.transitions) + "\n")
        except StatusError as exc:
            err.write(f"vllm-lifeguard status: {exc}\n")
            return 1
        return 0
    try:
        while True:
            try:
                text = render(fetch_state(url, token, args.timeout), transitions=args.transitions)
            except StatusError as exc:
                text = f"vllm-lifeguard status: {exc} (retrying)"
            if out.isatty():
                out.write("\x1b[H\x1b[2J")  # home and clear: one frame on screen, not a scroll
            out.write(f"{state_url(url)}  every {args.interval:g} s  {time.strftime('%H:%M:%S')}  (Ctrl-C stops)\n\n")
            out.write(text + "\n\n")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
