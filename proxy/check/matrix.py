"""The matrix: every row, in the order a report shows them, each a hazard (what goes wrong with vLLM alone), the
vLLM issue and catalogue class it is (docs/verification.md), and the scenario that runs it (proxy/check/scenarios.py).
tests/conformance/test_matrix.py runs each row against the engine itself: a row added here runs there too."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .column import Column
from .offload_and_stall import kept_offload_tier, stall_behind_health
from .scenarios import (
    Finding,
    checkpoint_cycle,
    level2_without_reload,
    lora_across_wake,
    memory_follows_sleep,
    out_of_order,
    partial_wake_then_forward,
    pause_mode,
    prefix_cache_after_weight_change,
    repeated_sleep,
    request_during_sleep,
    resume_while_asleep,
    second_resume,
    sleep_wake,
    start_twice,
    wake_comma_tags,
    wake_lifts_pause,
    wake_unknown_tag,
    weight_update_in_order,
    weight_update_while_asleep,
)
from .version_scenarios import label_after_failed_chunk, relabel_without_change, spans_across_keep_update


@dataclass(frozen=True)
class Row:
    id: str
    title: str
    hazard: str  # what goes wrong with vLLM alone, in a sentence
    reference: str  # the vLLM issue and the catalogue class, where there are
    run: Callable[[Column], Awaitable[Finding]]
    group: str = "behavioural"  # behavioural, protocol or physical (RFC #45585's three)


ROWS: tuple[Row, ...] = (
    Row(
        "sleep-wake-level-0",
        "sleep and wake, level 0",
        "a 200 that is not true: flags, /health or the canary disagree after the call",
        "classes 4, 7",
        sleep_wake(0),
    ),
    Row(
        "sleep-wake-level-1",
        "sleep and wake, level 1",
        "a 200 while the engine is still asleep, dead, or answers garbage (unzeroed pages)",
        "vLLM #44972, #45552 · classes 6, 7",
        sleep_wake(1),
    ),
    Row(
        "sleep-wake-level-2",
        "sleep level 2, wake weights, reload, wake KV cache",
        "the documented level-2 order: each 200 must be true and the canary answer as before",
        "vLLM #29341 · class 5",
        sleep_wake(2),
    ),
    Row(
        "level-2-wake-without-reload",
        "level 2, full wake without reload_weights",
        "a 200, healthy, then garbage: the weights were discarded",
        "vLLM #29341, PR #54235 · class 5",
        level2_without_reload,
    ),
    Row(
        "repeated-sleep",
        "a second /sleep while asleep",
        "200, does nothing, and aborts requests queued during the sleep",
        "vLLM #45518 · class 2",
        repeated_sleep,
    ),
    Row(
        "request-during-sleep",
        "a request sent during a sleep",
        "queued by vLLM with no deadline: hangs as long as the sleep lasts",
        "vLLM #45268, PR #45326",
        request_during_sleep,
    ),
    Row("wake-unknown-tag", "/wake_up?tags=bogus", "200, still asleep", "class 3", wake_unknown_tag),
    Row(
        "wake-comma-tags",
        "/wake_up?tags=weights,kv_cache",
        "200, still asleep: the tags are one unknown tag",
        "class 3",
        wake_comma_tags,
    ),
    Row(
        "partial-wake-then-forward",
        "wake the weights only, then a request",
        "200 to the wake, then the request hangs: the KV cache still sleeps",
        "PR #44483 · class 4",
        partial_wake_then_forward,
    ),
    Row(
        "resume-while-asleep",
        "/resume while asleep",
        "200: the scheduler runs onto memory that is not mapped",
        "vLLM #44395 (the crash class)",
        resume_while_asleep,
    ),
    Row(
        "wake-lifts-pause",
        "/wake_up on a paused engine",
        "200, and the trainer's pause is silently lifted",
        "vLLM AsyncLLM.wake_up",
        wake_lifts_pause,
    ),
    Row("pause-abort", "/pause?mode=abort twice, /resume", "each 200 must be true", "RFC #45585", pause_mode("abort")),
    Row("pause-wait", "/pause?mode=wait twice, /resume", "each 200 must be true", "RFC #45585", pause_mode("wait")),
    Row("pause-keep", "/pause?mode=keep twice, /resume", "each 200 must be true", "RFC #45585", pause_mode("keep")),
    Row(
        "second-resume",
        "/resume after a wake",
        "the wake already resumed; a second resume deadlocks data-parallel ranks",
        "verl #7846 · class 17",
        second_resume,
    ),
    Row(
        "update-before-start",
        "/update_weights with no session",
        "must be refused, never a 200",
        "RFC #45585 (protocol)",
        out_of_order("/update_weights", {"update_info": {}}),
        "protocol",
    ),
    Row(
        "finish-before-start",
        "/finish_weight_update with no session",
        "must be refused, never a 200",
        "RFC #45585 (protocol)",
        out_of_order("/finish_weight_update", {}),
        "protocol",
    ),
    Row(
        "start-twice",
        "/start_weight_update twice",
        "the second must be refused",
        "RFC #45585 (protocol)",
        start_twice,
        "protocol",
    ),
    Row(
        "weight-update-in-order",
        "init, start, update, finish",
        "each 200 true; /weight_info reports the version",
        "RFC #45585",
        weight_update_in_order,
        "protocol",
    ),
    Row(
        "weight-update-while-asleep",
        "/start_weight_update while asleep",
        "200, then the update never returns and the engine core dies",
        "vLLM #57853",
        weight_update_while_asleep,
        "protocol",
    ),
    Row(
        "prefix-cache-after-weight-change",
        "the prefix cache after a weight change, a request kept",
        '/reset_prefix_cache answers 200 {"success": false}; later requests reuse KV of the old weights',
        "vLLM #46893, #57727 · class 21",
        prefix_cache_after_weight_change,
        "protocol",
    ),
    Row(
        "label-after-failed-chunk",
        "a label after a chunk of a weight update failed mid-way",
        "the weights are partial; /weight_info still names a version and /health says 200; the next request kills "
        "the engine",
        "vLLM PR #57854 · class 30",
        label_after_failed_chunk,
        "protocol",
    ),
    Row(
        "relabel-without-change",
        "/update_weight_version with no weight change",
        "200: spans and /weight_info name a new version of the same weights, and nothing says so",
        "vLLM #49040 · class 31",
        relabel_without_change,
        "protocol",
    ),
    Row(
        "spans-across-keep-update",
        "a stream's weight_versions across a keep-mode pause and a reload",
        "a reload sets no label: the spans name one version for tokens two weights produced (0.32: no spans)",
        "vLLM #49040 · classes 31, 32",
        spans_across_keep_update,
        "protocol",
    ),
    Row(
        "checkpoint-cycle",
        "a process checkpoint, a request and a sleep meanwhile (vLLM 0.34)",
        "a request while prepared is refused engine_paused behind a /health 200; /sleep answers 500",
        "class 25",
        checkpoint_cycle,
    ),
    Row(
        "kept-offload-tier",
        "a KV connector's tier kept through a sleep, then a weight update (vLLM 0.34)",
        "after /reset_prefix_cache 200 a cached prompt is answered from KV the old weights computed",
        "vLLM PR #57810 · class 28",
        kept_offload_tier,
        "protocol",
    ),
    Row(
        "stall-behind-health",
        "a request that makes no progress while /health answers 200",
        "nothing tells a router: /health 200 while requests get no byte",
        "class 27",
        stall_behind_health,
    ),
    Row(
        "lora-across-wake",
        "a LoRA adapter across a level-1 sleep and wake",
        "200, still listed, answers like the base model",
        "vLLM #53888 · class 12",
        lora_across_wake,
    ),
    Row(
        "memory-follows-sleep",
        "GPU memory at a level-1 sleep and wake",
        "a 200 with the memory not freed, or not back",
        "PR #45586 · classes 1, 6",
        memory_follows_sleep,
        "physical",
    ),
)


def select(ids: list[str] | None) -> tuple[Row, ...]:
    """The rows named (all of them when none is); an unknown name is a `ValueError` listing the known ones."""
    if not ids:
        return ROWS
    known = {row.id: row for row in ROWS}
    unknown = [name for name in ids if name not in known]
    if unknown:
        raise ValueError(f"unknown row {', '.join(unknown)}: the rows are {', '.join(known)}")
    return tuple(known[name] for name in ids)
