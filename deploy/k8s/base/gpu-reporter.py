"""Write the memory of this container's GPUs to a JSON file, for vllm-lifeguard's `file:` GPU probe.

Runs in the background inside the vLLM container, which is the only container of the pod that holds
the GPUs (the sidecar asks for none). NVML there sees exactly the GPUs the device plugin gave vLLM.
Standard library plus `pynvml` (nvidia-ml-py, already a vLLM dependency); never disturbs vLLM: on
any NVML failure it removes the file (the sidecar then reports the probe "unavailable") and retries.

    python3 gpu-reporter.py /run/lifeguard/gpu.json [--interval 0.2] [--once]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def snapshot(nvml: Any) -> dict[str, Any]:
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        devices.append(
            {
                "index": index,
                "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                "used_bytes": int(memory.used),
                "total_bytes": int(memory.total),
            }
        )
    return {
        "used_bytes": sum(device["used_bytes"] for device in devices),
        "total_bytes": sum(device["total_bytes"] for device in devices),
        "devices": devices,
        "updated_at": time.time(),
    }


def write_atomically(path: str, data: dict[str, Any]) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args(argv)
    # On Kubernetes the emptyDir is the directory; anywhere else (the README's line on a plain host) it may not exist.
    directory = os.path.dirname(os.path.abspath(args.path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        print(
            f"gpu-reporter: cannot create {directory} ({error.strerror}): give a path in a directory this user can "
            f"write, and the same path to the proxy as --gpu-probe file:PATH",
            file=sys.stderr,
        )
        return 2
    remove(args.path)  # never leave a previous run's numbers behind
    try:
        import pynvml as nvml
    except ImportError:
        print("gpu-reporter: pynvml not installed; no GPU memory for the sidecar", file=sys.stderr)
        return 1
    initialised = False
    last_error = None
    while True:
        try:
            if not initialised:
                nvml.nvmlInit()
                initialised = True
            write_atomically(args.path, snapshot(nvml))
            last_error = None
        except OSError as error:  # the directory went away, or the disk is full: said once, retried
            if str(error) != last_error:
                print(f"gpu-reporter: cannot write {args.path} ({error.strerror}); retrying every 5 s", file=sys.stderr,
                      flush=True)  # fmt: skip
                last_error = str(error)
            if args.once:
                return 1
            time.sleep(5)
            continue
        except nvml.NVMLError as error:
            remove(args.path)
            if str(error) != last_error:  # once per distinct error, not every retry
                print(f"gpu-reporter: NVML error, retrying every 5 s: {error}", file=sys.stderr, flush=True)
                last_error = str(error)
            initialised = False
            if args.once:
                return 1
            time.sleep(5)
            continue
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
