"""vLLM's own `/weight_checker` through the proxy (issue 42), against the real vLLM-for-CPU 0.32.

* The reset hole: vLLM answers `{"action": "reset"}` 200 having set every weight to zero, and serves the zero model
  after it. Through the proxy a completion sent after the reset is held, then answered with the checkpoint's text
  once `reload_weights` has run, and `compare` against the checksums from before the reset matches.
* A reload that does not produce the checkpoint: a vLLM of its own (a larger random model, built here) is started
  after its proxy, so the proxy sees it come up and takes the checkpoint's checksums; one tensor of the model's file
  is then changed on disk, and a `reload_weights` through the proxy is 503 naming that tensor, inference held until
  a reload produces the checkpoint again. (The session's shared model is not touched: other runs read it.)
* What a checksum costs per GiB of weights, on the tiny model and on the larger one: printed, and appended to
  `$LIFEGUARD_VLLM_LOG_DIR/weight-checksum-cost.jsonl` (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm.conftest import REPO, Proxy, free_port, vllm_server_mod
from tests.vllm.vllm_e2e import MODEL, engine_never_saw_it, lg_state, post, wait_held, wait_until

pytestmark = [pytest.mark.vllm]

RELOAD = {"method": "reload_weights"}
PROMPT = {"prompt": "hello world the model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
# A norm: vLLM-for-CPU repacks the linear layers for oneDNN and leaves their parameters empty (their digest is the
# empty string's whatever they hold), so on this machine only the embeddings and norms are evidence.
CHANGED = "model.layers.0.input_layernorm.weight"
EMPTY = hashlib.sha256(b"").hexdigest()
GIB = float(1 << 30)


async def _checksums(s: aiohttp.ClientSession, base: str) -> dict[str, str]:
    status, body, _ = await post(s, base + "/weight_checker", json={"action": "checksum"})
    assert status == 200, body
    return dict(body["checksums"])


async def _text(s: aiohttp.ClientSession, base: str, model: str = MODEL) -> str:
    status, body, _ = await post(s, base + "/v1/completions", json={"model": model, **PROMPT})
    assert status == 200, body
    return str(body["choices"][0]["text"])


def _weight_bytes(model_dir: Path, served_bytes_per_element: int = 4) -> int:
    """The weights vLLM holds for `model_dir`'s safetensors, served as float32 (`--dtype float32`)."""
    raw = (model_dir / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    elements = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for dim in entry["shape"]:
                n *= dim
            elements += n
    return elements * served_bytes_per_element


def _report(row: dict[str, Any]) -> None:
    sys.stderr.write(f"\n[weight-checksum-cost] {json.dumps(row)}\n")
    log_dir = os.environ.get("LIFEGUARD_VLLM_LOG_DIR")
    if log_dir:
        with open(Path(log_dir) / "weight-checksum-cost.jsonl", "a") as report:
            report.write(json.dumps(row) + "\n")


def _digest_cost(model_dir: Path) -> dict[str, Any]:
    """vLLM's own `compute_tensor_digests` over every parameter (scripts/vllm/checksum_cost.py), float32 as served."""
    script = REPO / "scripts/vllm/checksum_cost.py"
    python = os.environ["LIFEGUARD_VLLM_PYTHON"]
    done = subprocess.run([python, str(script), str(model_dir), "float32", "5"], check=True, timeout=300,
                          capture_output=True, text=True)  # fmt: skip
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    _report({"what": "compute_tensor_digests, every parameter", **row})
    return row


async def _cost(s: aiohttp.ClientSession, vllm_url: str, model_dir: Path, label: str, rounds: int = 5) -> float:
    """Seconds of one `/weight_checker` checksum sent to vLLM directly (median of `rounds`); on vLLM-for-CPU it hashes
    only the embeddings and norms (the linear layers' parameters are empty), so the cost per GiB of weights is
    measured by `_digest_cost` on every parameter."""
    seconds = []
    for _ in range(rounds):
        started = time.monotonic()
        digests = await _checksums(s, vllm_url)
        seconds.append(time.monotonic() - started)
    weight_bytes = _weight_bytes(model_dir)
    median = statistics.median(seconds)
    row = {
        "what": "POST /weight_checker checksum, vLLM-for-CPU",
        "model": label,
        "tensors": len(digests),
        "empty_tensors": sum(1 for digest in digests.values() if digest == EMPTY),
        "weight_gib": round(weight_bytes / GIB, 4),
        "seconds_median": round(median, 4),
        "seconds_all": [round(x, 4) for x in seconds],
        "cpu_count": os.cpu_count(),
    }
    _report(row)
    return median


@pytest.mark.timeout(240)
async def test_a_completion_after_a_reset_is_held_and_answered_from_the_reloaded_checkpoint(
    proxy: Proxy, vllm_server: Any, session: aiohttp.ClientSession
) -> None:
    s, base, vllm = session, proxy.url, vllm_server.url
    try:
        assert (await post(s, base + "/collective_rpc", json=RELOAD))[0] == 200  # the checkpoint, whatever came before
        before = await _checksums(s, base)
        expected = await _text(s, base)

        status, body, _ = await post(s, base + "/weight_checker", json={"action": "reset"})

        assert (status, body) == (200, {"status": "reset"})
        state = await lg_state(s, base)
        assert state["weights_stale"] is True and state["weights_stale_reason"] == "reset", state
        _, compare, _ = await post(s, vllm + "/weight_checker", json={"action": "compare", "baseline": before})
        # every tensor with bytes is zeroed; on CPU the 8 repacked linear layers' parameters are empty (see CHANGED)
        assert compare["mismatches"] == sorted(key for key, digest in before.items() if digest != EMPTY), compare
        held = asyncio.ensure_future(post(s, base + "/v1/completions", json={"model": MODEL, **PROMPT}))
        await wait_held(s, base, 1)
        await engine_never_saw_it(s, vllm)
        assert await _text(s, vllm) != expected  # the hole: vLLM itself serves the zero model

        assert (await post(s, base + "/collective_rpc", json=RELOAD))[0] == 200

        status, body, _ = await asyncio.wait_for(held, 60)
        assert status == 200 and body["choices"][0]["text"] == expected, body
        _, compare, _ = await post(s, base + "/weight_checker", json={"action": "compare", "baseline": before})
        assert compare == {"match": True, "mismatches": []}
        assert (await lg_state(s, base))["weights_stale"] is False
    finally:
        await post(s, vllm + "/collective_rpc", json=RELOAD)  # the shared vLLM never keeps zeroed weights


@pytest.mark.timeout(120)
async def test_the_checksum_cost_on_the_tiny_model(vllm_server: Any, session: aiohttp.ClientSession) -> None:
    assert await _cost(session, vllm_server.url, Path(vllm_server.model), "tiny-llama") > 0
    assert _digest_cost(Path(vllm_server.model))["weight_gib"] > 0


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Proxy, Path]]:
    """A vLLM of its own on a larger random model, started after the proxy in front of it."""
    if not os.environ.get("LIFEGUARD_VLLM_PYTHON") or not os.environ.get("LIFEGUARD_VLLM_MODEL"):
        pytest.skip("LIFEGUARD_VLLM_PYTHON/LIFEGUARD_VLLM_MODEL unset: run `make test-vllm`")
    python, tiny = os.environ["LIFEGUARD_VLLM_PYTHON"], os.environ["LIFEGUARD_VLLM_MODEL"]
    model_dir = tmp_path_factory.mktemp("larger-llama")
    builder = REPO / "scripts/vllm/make_larger_model.py"
    subprocess.run([python, str(builder), tiny, str(model_dir)], check=True, timeout=300, capture_output=True)
    log_dir = tmp_path_factory.mktemp("larger-logs")
    server = vllm_server_mod.VllmServer(model=str(model_dir), log_path=log_dir / "vllm-larger.log")
    proxy = Proxy(port=free_port(), upstream=server.url, log_path=log_dir / "proxy-larger.log")
    server.spawn()
    # The proxy starts while vLLM loads, so it sees vLLM come up holding its checkpoint; its start waits for RUNNING,
    # so it runs beside vLLM's own wait, which fails with vLLM's log if vLLM dies.
    starting = threading.Thread(target=proxy.start, kwargs={"timeout": 400}, daemon=True)
    starting.start()
    try:
        server.wait_healthy(360)
        starting.join(60)
        assert not starting.is_alive() and proxy.starts, f"the proxy is not RUNNING: {proxy.log_tail()}"
        yield server, proxy, model_dir
    finally:
        proxy.stop()
        server.stop()


def _scale_tensor_on_disk(python: str, model_dir: Path, name: str) -> None:
    code = (
        "import sys; from safetensors.torch import load_file, save_file; "
        "p = sys.argv[1]; t = load_file(p); t[sys.argv[2]] = t[sys.argv[2]] * 2; "
        "save_file(t, p, metadata={'format': 'pt'})"
    )
    subprocess.run([python, "-c", code, str(model_dir / "model.safetensors"), name], check=True, timeout=120)


@pytest.mark.timeout(600)
async def test_a_reload_after_the_checkpoints_file_changed_on_disk_is_caught_by_the_checkpoint_checksums(
    larger: tuple[Any, Proxy, Path], session: aiohttp.ClientSession
) -> None:
    server, proxy, model_dir = larger
    s, base = session, proxy.url
    model = server.served_model_name
    state = await wait_until(
        lambda: lg_state(s, base),
        lambda st: st["weight_checksums"]["checkpoint_tensors"] is not None,
        60,
        "the checkpoint's checksums taken",
    )
    assert state["weight_checksums"]["mode"] == "reloads"
    await _cost(s, server.url, model_dir, "larger-llama")
    assert _digest_cost(model_dir)["weight_gib"] > 0.4
    expected = await _text(s, base, model)
    original = model_dir / "model.safetensors.orig"
    shutil.copy(model_dir / "model.safetensors", original)
    _scale_tensor_on_disk(os.environ["LIFEGUARD_VLLM_PYTHON"], model_dir, CHANGED)

    status, body, _ = await post(s, base + "/collective_rpc", json=RELOAD)

    assert status == 503, body
    assert body["error"]["reason"] == "verification_failed", body
    assert f"1 of {state['weight_checksums']['checkpoint_tensors']} weight tensors differ" in body["error"]["message"]
    assert f"dp0:pp0:pcp0:tp0:{CHANGED}" in body["error"]["message"]
    assert (await lg_state(s, base))["weights_stale_reason"] == "mismatch"
    held = asyncio.ensure_future(post(s, base + "/v1/completions", json={"model": model, **PROMPT}))
    await wait_held(s, base, 1)

    shutil.copy(original, model_dir / "model.safetensors")  # the checkpoint's file as it was
    status, body, _ = await post(s, base + "/collective_rpc", json=RELOAD)

    assert status == 200, body
    status, body, _ = await asyncio.wait_for(held, 60)
    assert status == 200 and body["choices"][0]["text"] == expected, body
