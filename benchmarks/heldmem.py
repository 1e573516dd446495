"""Where the bytes of a held request go: the proxy under tracemalloc in front of the sleeping fake vLLM.

Starts upstream.py and `python -m proxy serve` (from `--proxy-src`) with tracemalloc on, opens
`--count` client connections, then sends one completion on each while the engine sleeps. The proxy writes a
snapshot on SIGUSR1; printed: the traced bytes per client, grouped by file:line, for the open connection and
for the held request, and the RSS delta beside them (tracemalloc's own bookkeeping is in the RSS here).
Usage: .venv/bin/python -m benchmarks.heldmem [--count 4000] [--proxy-src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import linecache
import signal
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

from benchmarks.hold import HeldClient
from benchmarks.procs import free_port, http, rss_bytes, wait_until

HERE = Path(__file__).resolve().parent
SERVE = """
import os, signal, sys, tracemalloc
tracemalloc.start(1)
def dump(signum, frame):
    tracemalloc.take_snapshot().dump(sys.argv[1] + ".part")
    os.rename(sys.argv[1] + ".part", sys.argv[1])
signal.signal(signal.SIGUSR1, dump)
from proxy.cli import main
sys.exit(main(sys.argv[2:]))
"""


Measured = tuple[tracemalloc.Snapshot, int]


def report(title: str, before: Measured, after: Measured, n: int) -> None:
    diff = after[0].compare_to(before[0], "lineno")
    total = sum(d.size_diff for d in diff)
    own = sum(d.size_diff for d in diff if "/proxy/" in d.traceback[0].filename)
    rss = (after[1] - before[1]) / n
    print(f"\n{title}: traced {total / n:.0f} B per client ({own / n:.0f} B in proxy/, the rest asyncio, socket and "
          f"the interpreter), RSS {rss:.0f} B per client (tracemalloc's own bookkeeping too)")  # fmt: skip
    for d in diff[:16]:
        if abs(d.size_diff) / n < 8:
            break
        frame = d.traceback[0]
        where = f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno}"
        code = linecache.getline(frame.filename, frame.lineno).strip()[:60]
        print(f"  {d.size_diff / n:6.0f} B {d.count_diff / n:5.2f} blocks  {where:34} {code}")


async def run(count: int, src: Path) -> None:
    out = Path(tempfile.mkdtemp(prefix="heldmem."))
    up_port, lg_port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "--port", str(up_port)])
    argv = ["serve", "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(lg_port), "--gpu-probe", "none"]
    argv += ["--no-canary", "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(out / "snap"), *argv], cwd=src)
    try:

        async def running() -> bool:
            status, body = await http(lg_port, "GET", "/lifeguard/state", timeout=2)
            return status == 200 and json.loads(body)["state"] == "RUNNING"

        await wait_until(running, "the proxy to run")
        status, _ = await http(lg_port, "POST", "/sleep?level=1")
        assert status == 200, status
        loop = asyncio.get_running_loop()
        snaps = [await _snap(proc, out)]
        clients: list[HeldClient] = []
        for start in range(0, count, 250):
            batch = [loop.create_connection(HeldClient, "127.0.0.1", lg_port) for _ in range(min(250, count - start))]
            clients += [proto for _, proto in await asyncio.gather(*batch)]
        snaps.append(await _snap(proc, out))
        for c in clients:
            c.send()

        async def all_held() -> bool:
            _, body = await http(lg_port, "GET", "/lifeguard/state")
            return bool(json.loads(body)["held_requests"] >= count)

        await wait_until(all_held, f"{count} held", timeout=120)
        snaps.append(await _snap(proc, out))
        report("open connection", snaps[0], snaps[1], count)
        report("held request", snaps[1], snaps[2], count)
        report("held client (both)", snaps[0], snaps[2], count)
        for c in clients:
            c.transport.close()
    finally:
        proc.terminate()
        upstream.terminate()
        proc.wait()
        upstream.wait()
        out.rmdir()  # each snapshot is removed once read


async def _snap(proc: subprocess.Popen[bytes], out: Path) -> Measured:
    """A snapshot of the proxy's traced memory, and its RSS, once it has settled."""
    await asyncio.sleep(1.0)
    rss = rss_bytes(proc.pid)
    proc.send_signal(signal.SIGUSR1)
    while not (out / "snap").exists():
        await asyncio.sleep(0.2)
    snap = tracemalloc.Snapshot.load(str(out / "snap"))
    (out / "snap").unlink()
    return snap, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--proxy-src", default=str(HERE.parent))
    args = parser.parse_args()
    asyncio.run(run(args.count, Path(args.proxy_src).resolve()))


if __name__ == "__main__":
    main()
