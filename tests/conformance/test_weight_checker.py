"""`POST /weight_checker` (vLLM 0.32 `vllm/entrypoints/rl/online/api_router.py`): checksum, compare, reset.

Runs against both simulator profiles and, with `CONFORMANCE_ENGINE_URL`, against a real vLLM: the simulator's
copy (lifeguard_sim/weight_checker.py) must answer as vLLM does. Every scenario that resets loads the
checkpoint again before it ends, so the engine is left as it was found.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator

import pytest

from tests.conformance.api import VllmApi

RELOAD = {"method": "reload_weights"}
EMPTY = hashlib.sha256(b"").hexdigest()


async def _checksums(vllm: VllmApi) -> dict[str, str]:
    answer = await vllm.call("POST", "/weight_checker", json_body={"action": "checksum"})
    assert answer.status == 200, answer.text
    return dict(answer.body["checksums"])


@pytest.fixture
async def reloaded(vllm: VllmApi) -> AsyncIterator[VllmApi]:
    """The engine holding its checkpoint, before and after the test (a reset must not outlive it)."""
    assert (await vllm.call("POST", "/collective_rpc", json_body=RELOAD)).status == 200
    try:
        yield vllm
    finally:
        assert (await vllm.call("POST", "/collective_rpc", json_body=RELOAD)).status == 200


async def test_checksums_are_a_sha256_per_tensor_keyed_by_the_workers_ranks(vllm: VllmApi) -> None:
    checksums = await _checksums(vllm)
    assert checksums
    for key, digest in checksums.items():
        assert re.fullmatch(r"dp0:pp0:pcp0:tp0:[\w.]+", key), key
        assert re.fullmatch(r"[0-9a-f]{64}", digest), digest
    assert await _checksums(vllm) == checksums  # reading them changes nothing


async def test_compare_answers_match_and_the_sorted_mismatches(vllm: VllmApi) -> None:
    checksums = await _checksums(vllm)
    same = await vllm.call("POST", "/weight_checker", json_body={"action": "compare", "baseline": checksums})
    assert (same.status, same.body) == (200, {"match": True, "mismatches": []})
    first = sorted(checksums)[0]
    other = {**checksums, first: "0" * 64, "extra.weight": "1" * 64}
    differ = await vllm.call("POST", "/weight_checker", json_body={"action": "compare", "baseline": other})
    assert (differ.status, differ.body) == (200, {"match": False, "mismatches": sorted([first, "extra.weight"])})


async def test_compare_without_a_baseline_and_an_unknown_action_are_400(vllm: VllmApi) -> None:
    answer = await vllm.call("POST", "/weight_checker", json_body={"action": "compare"})
    assert answer.status == 400 and "requires a 'baseline' object" in answer.text
    answer = await vllm.call("POST", "/weight_checker", json_body={"action": "zero"})
    assert answer.status == 400 and "literal_error" in answer.text
    answer = await vllm.call("POST", "/weight_checker", json_body={})
    assert answer.status == 400 and "missing" in answer.text


async def test_reset_zeroes_every_tensor_until_reload_weights_brings_the_checkpoint_back(reloaded: VllmApi) -> None:
    vllm = reloaded
    before = await _checksums(vllm)
    golden = (await vllm.completion(prompt="Paris is the capital of", max_tokens=8, ignore_eos=True)).body

    answer = await vllm.call("POST", "/weight_checker", json_body={"action": "reset"})

    assert (answer.status, answer.body) == (200, {"status": "reset"})
    compare = await vllm.call("POST", "/weight_checker", json_body={"action": "compare", "baseline": before})
    # Every tensor with bytes is zeroed. vLLM-for-CPU repacks its linear layers for oneDNN and leaves their
    # parameters empty (`dispatch_cpu_unquantized_gemm`): their digest is the empty string's, before and after.
    zeroed_keys = sorted(key for key, digest in before.items() if digest != EMPTY)
    assert compare.body == {"match": False, "mismatches": zeroed_keys}
    zeroed = (await vllm.completion(prompt="Paris is the capital of", max_tokens=8, ignore_eos=True)).body
    assert zeroed["choices"][0]["text"] != golden["choices"][0]["text"]
    assert (await vllm.call("POST", "/collective_rpc", json_body=RELOAD)).status == 200
    compare = await vllm.call("POST", "/weight_checker", json_body={"action": "compare", "baseline": before})
    assert compare.body == {"match": True, "mismatches": []}
