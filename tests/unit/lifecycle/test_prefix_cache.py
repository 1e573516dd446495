"""The salt merged into an admitted request's body while old-weight blocks remain (proxy/lifecycle/prefix_cache.py),
checked
against vLLM's own validate_cache_salt rules as the simulator mirrors them (lifeguard_sim/prefix_cache.py)."""

from __future__ import annotations

import json

import pytest

from lifeguard_sim.prefix_cache import PrefixCache, salt_problem
from proxy.lifecycle.persisted_facts import PersistedFacts
from proxy.lifecycle.prefix_cache import Partition, reset_result, salted
from proxy.lifecycle.state_file import StateFile

SALT = Partition.after("test").salt


def _salt_of(body: bytes) -> object:
    return json.loads(salted(body, SALT))["cache_salt"]


def test_a_request_without_a_salt_gets_the_proxys_and_keeps_everything_else() -> None:
    body = {"model": "tiny", "prompt": "héllo", "max_tokens": 3, "stream": True}
    out = json.loads(salted(json.dumps(body).encode(), SALT))
    assert out == {**body, "cache_salt": SALT}
    assert salt_problem(SALT) is None


def test_a_clients_salt_is_joined_so_tenants_stay_apart() -> None:
    a, b = _salt_of(b'{"cache_salt": "tenant-a"}'), _salt_of(b'{"cache_salt": "tenant-b"}')
    assert a != b and str(a).startswith("tenant-a") and str(a).endswith(SALT)
    assert salt_problem(a) is None


def test_a_long_client_salt_is_replaced_by_its_digest_within_vllms_limit() -> None:
    long_a, long_b = "a" * 128, "a" * 127 + "b"
    merged_a, merged_b = (
        _salt_of(json.dumps({"cache_salt": long_a}).encode()),
        _salt_of(json.dumps({"cache_salt": long_b}).encode()),
    )
    assert merged_a != merged_b
    assert salt_problem(merged_a) is None and salt_problem(merged_b) is None


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"cache_salt": "a/b"}', b'{"cache_salt": ""}'])
def test_what_vllm_would_refuse_anyway_is_left_for_vllm_to_answer(body: bytes) -> None:
    assert salted(body, SALT) == body


@pytest.mark.parametrize(
    ("status", "body", "result"),
    [
        (200, b'{"success": true}', True),
        (200, b'{"success": false}', False),
        (200, b'{"status": "ok"}', None),  # SkyRL's server wrapper: it does not say
        (500, b'{"success": true}', None),
        (200, b"oops", None),
    ],
)
def test_what_a_reset_answer_says(status: int, body: bytes, result: bool | None) -> None:
    assert reset_result(status, body) is result


def test_the_partition_survives_the_state_file(tmp_path: object) -> None:
    path = f"{tmp_path}/state.json"
    partition = Partition.after("a weight update session finished")
    StateFile(path).save(PersistedFacts(prefix_partition=partition))
    assert StateFile(path).load() == PersistedFacts(prefix_partition=partition)


def test_the_simulators_cache_chains_blocks_from_a_salted_first_one() -> None:
    cache = PrefixCache(block_tokens=4)
    prompt = list(range(10))
    assert cache.serve(prompt, salt=None, lora=None, weights="w0") == (0, None)
    assert cache.serve(prompt, salt=None, lora=None, weights="w1") == (8, "w0")  # two whole blocks, old weights
    assert cache.serve(prompt, salt="s", lora=None, weights="w1") == (0, None)  # the salt is in the first block
    assert cache.serve([99, *prompt[1:]], salt=None, lora=None, weights="w1") == (0, None)  # chained from the first
    cache.reset()
    assert cache.serve(prompt, salt=None, lora=None, weights="w1") == (0, None)
