"""Which processes of this host are one engine: the one listening on its port and that process's descendants
(vLLM's API server spawns its EngineCore and worker processes, which hold the GPU memory). Read from /proc.

What it needs: the engine in the same network namespace (its port is in this /proc/net/tcp: a pod's containers
share one) and its processes visible (the same PID namespace: `shareProcessNamespace: true` in a pod, or the
same host), readable by this user. Where they are not, the answer is empty and the caller says so: the engine's
own GPU memory cannot be told apart from its neighbours' then (NVML lists only the processes it can see).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
# Processes come and go with an engine's restart: the set is found again when one of them is gone, and at least
# this often (a worker spawned late).
_REFRESH_S = 30.0


class EngineProcesses:
    def __init__(self, port: int, proc: Path = Path("/proc")) -> None:
        self.port = port
        self._proc = proc
        self._pids: frozenset[int] = frozenset()
        self._found_at = float("-inf")

    def pids(self) -> frozenset[int]:
        """The engine's processes now (empty when none can be seen)."""
        stale = time.monotonic() - self._found_at > _REFRESH_S
        if stale or not self._pids or not all(_alive(self._proc / str(pid)) for pid in self._pids):
            self._pids = frozenset(self._find())
            self._found_at = time.monotonic()
        return self._pids

    def _find(self) -> set[int]:
        inodes = self._listening_inodes()
        if not inodes:
            return set()
        sockets = {f"socket:[{inode}]" for inode in inodes}
        owners: set[int] = set()
        parents: dict[int, int] = {}
        for entry in self._proc.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            parent = _parent(entry)
            if parent is None:
                continue  # gone, or a zombie: it holds no memory any more
            parents[pid] = parent
            try:
                if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                    owners.add(pid)
            except OSError:
                continue  # gone meanwhile, or not ours to read
        return _with_descendants(owners, parents)

    def _listening_inodes(self) -> set[str]:
        inodes = set()
        for table in ("tcp", "tcp6"):
            try:
                lines = (self._proc / "net" / table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == self.port:
                    inodes.add(fields[9])
        return inodes


def _parent(entry: Path) -> int | None:
    """The parent of a live process; None for one that is gone or a zombie."""
    try:
        stat = (entry / "stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid ...: the command may hold spaces and parentheses; the last ')' ends it.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 2 or fields[0] in ("Z", "X"):
        return None
    return int(fields[1])


def _alive(entry: Path) -> bool:
    return _parent(entry) is not None


def _with_descendants(roots: set[int], parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found = set(roots)
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
