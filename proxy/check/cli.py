"""`vllm-lifeguard check URL`: the command line of the check. Exit 0 when every row a client sees (through the
lifeguard where there is one) is green, 1 otherwise, 2 when the target could not be checked."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from ..observe.admin_token import client_admin_token
from .html import to_html
from .matrix import ROWS, select
from .report import document, to_json, to_markdown, to_terminal
from .run import Options, check
from .target import CheckError

EXIT_UNCHECKED = 2
_EPILOG = """examples:
  vllm-lifeguard check http://127.0.0.1:8080                 read-only: what is there, nothing changed
  vllm-lifeguard check http://127.0.0.1:8080 --lifecycle     the matrix: vLLM itself and through the lifeguard
  vllm-lifeguard check --direct http://vllm:8000 --through http://lifeguard:8080 --lifecycle --html matrix.html

rows (--row ID, repeatable):
""" + "\n".join(f"  {row.id:<34} {row.title}" for row in ROWS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-lifeguard check",
        description="What a vLLM deployment gets wrong in its lifecycle (sleep, wake, pause, resume, weight "
        "updates), and what a client sees through the lifeguard. Read-only unless --lifecycle.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("url", nargs="?", help="a vLLM or a lifeguard (its upstream, when reachable, becomes the direct column)")
    add("--direct", metavar="URL", help="vLLM itself")
    add("--through", metavar="URL", help="the lifeguard in front of it")
    add("--no-direct", action="store_true", help="through the lifeguard only, even when its vLLM is reachable")
    add("--lifecycle", action="store_true", help="run the matrix: DISRUPTIVE (sleeps, wakes, pauses the engine)")
    add("--force", action="store_true", help="run --lifecycle even on an engine that is not idle")
    add("--row", action="append", dest="rows", metavar="ID", help="run only this row (repeatable)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token-file", help="the lifeguard's admin token, from this file (default: $LIFEGUARD_ADMIN_TOKEN)"
    )
    token.add_argument("--token", help="the admin token (shows in `ps`: prefer $LIFEGUARD_ADMIN_TOKEN)")
    add("--gpu-probe", default="nvml", help="GPU memory for the physical rows: nvml | file:PATH | none (default nvml)")
    add("--lora", action="append", default=[], metavar="NAME=PATH", help="load this LoRA adapter for the LoRA row")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the JSON report (schema vllm-lifeguard-check/1)")
    out.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    add("--html", metavar="FILE", help="also write the report as one self-contained HTML page")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for url in (args.url, args.direct, args.through):
        if url is not None and not url.startswith(("http://", "https://")):
            parser.error(f"{url!r} is not an http:// or https:// URL")
    if not (args.url or args.direct or args.through):
        parser.error("give a URL to check (vLLM or a lifeguard), or --direct URL and --through URL")
    if args.rows:  # checked before anything is read, --lifecycle or not: one sentence, exit 2
        try:
            select(args.rows)
        except ValueError as exc:
            return _unchecked(str(exc))
        if not args.lifecycle:
            return _unchecked(
                "--row picks rows of the lifecycle matrix: add --lifecycle (it sleeps and wakes the engine)"
            )
    lora = []
    for spec in args.lora:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path:
            parser.error(f"--lora {spec!r}: expected NAME=PATH")
        lora.append((name, path))
    try:
        token = client_admin_token(args.token, args.token_file)
    except OSError as exc:
        parser.error(f"cannot read --token-file: {exc.strerror}")
    options = Options(
        url=args.url,
        direct=args.direct,
        through=args.through,
        lifecycle=args.lifecycle,
        force=args.force,
        rows=args.rows,
        token=token,
        gpu_probe=args.gpu_probe,
        lora=lora,
    )
    try:
        report = asyncio.run(check(options))
    except (CheckError, ValueError) as exc:
        return _unchecked(str(exc))
    except KeyboardInterrupt:
        print("vllm-lifeguard check: interrupted; the engine may be left asleep or paused", file=sys.stderr)
        return 130
    doc = document(report)
    if args.json:
        sys.stdout.write(to_json(doc))
    elif args.markdown:
        sys.stdout.write(to_markdown(doc))
    else:
        sys.stdout.write(to_terminal(doc, colour=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
    if args.html:
        try:
            Path(args.html).write_text(to_html(doc), encoding="utf-8")
        except OSError as exc:
            print(f"vllm-lifeguard check: cannot write {args.html}: {exc.strerror}", file=sys.stderr)
            return EXIT_UNCHECKED
    return report.exit_code


def _unchecked(why: str) -> int:
    print(f"vllm-lifeguard check: {why}", file=sys.stderr)
    return EXIT_UNCHECKED
