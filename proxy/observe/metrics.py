"""Prometheus metrics: every series the proxy exports (with request_metrics.py, the only prometheus_client users).

Owns the metric objects, names, HELP texts, buckets and closed label sets; callers report events through
intention-named methods. Every label value comes from a closed tuple (another raises `KeyError`), every known
combination exists at 0 from the start, the registry is injected, and every series about an engine carries an
`engine` label, a single engine's too. The metrics: docs/reference/metrics.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder

from .request_metrics import CounterFamily, HistogramFamily
from .version_metrics import VersionFamilies

__all__ = [
    "CHECKS",
    "CHECK_RESULTS",
    "HOLD_OUTCOMES",
    "INFERENCE_OUTCOMES",
    "LIFECYCLE_BUCKETS",
    "OPERATION_OUTCOMES",
    "POLICIES",
    "REQUEST_BUCKETS",
    "ROUTE_CLASSES",
    "EngineMetrics",
    "Metrics",
]

#: Methods kept as they are in the unknown-route series; any other is "other".
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: Distinct (method, path template) series of unknown routes before they are folded into "other".
UNKNOWN_ROUTE_LABELS = 64

#: How a lifecycle call (sleep, wake_up, pause ...) ended, as answered to its caller.
OPERATION_OUTCOMES: tuple[str, ...] = (
    "ok",  # forwarded, upstream 200, verified
    "noop",  # answered by us without touching vLLM (already in the asked-for state)
    "joined",  # an identical call was in flight; this one shared its outcome
    "invalid",  # 400: a parameter failed validation, nothing sent
    "refused",  # 409: not allowed from the current state
    "busy",  # 409 lifecycle_busy: waited its turn past the deadline
    "unauthorized",  # admin token missing or wrong
    "upstream_error",  # vLLM answered 5xx, timed out, reset or was unreachable
    "verification_failed",  # vLLM said 200 but the checks disagreed (a "200 lie")
)

#: How a held inference request left the hold queue.
HOLD_OUTCOMES: tuple[str, ...] = (
    "forwarded",
    "client_gone",
    "hold_timeout",
    "hold_queue_full",
    "shutting_down",
    "engine_unavailable",
    "engine_retired",  # an elastic-EP scale-down retired this rank (proxy/upstream/elastic_ep.py)
    "insufficient_gpu_memory",
)

#: How an inference request ended at the proxy (counted once, when it ends).
INFERENCE_OUTCOMES: tuple[str, ...] = (
    *HOLD_OUTCOMES,
    "engine_sleeping",
    "upstream_unreachable",
    "stream_broken",
    "body_too_large",
    "aborted_by_sleep",
    "proxy_error",
)

#: Which table row a request was classified under.
ROUTE_CLASSES: tuple[str, ...] = ("inference", "lifecycle", "passthrough")

#: Verification checks run after a lifecycle 200, and their results.
CHECKS: tuple[str, ...] = ("flags", "health", "memory", "canary", "lora", "weights", "checkpoint", "snapshot")
CHECK_RESULTS: tuple[str, ...] = ("pass", "fail", "unavailable")

#: Operating policies that can act on their own.
POLICIES: tuple[str, ...] = ("wake_on_request", "idle_sleep", "drain_before_sleep")

#: Lifecycle operations: a wake with CUDA graph capture or a weight reload takes tens of seconds,
#: so the buckets reach 10 minutes (prometheus_client's defaults stop at 10 s).
LIFECYCLE_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

#: Requests and holds: from sub-millisecond passthroughs to generations and holds of many minutes.
REQUEST_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


#: Where in the proxy a bug (an unexpected exception) was caught, for ``lifeguard_proxy_errors_total``.
PROXY_ERROR_PLACES: tuple[str, ...] = ("client", "forward", "hold", "answer", "upstream")

#: How a swap (a wake of one of several engines on shared GPUs, with the room made for it) ended.
SWAP_OUTCOMES: tuple[str, ...] = ("ok", "no_room", "failed")

#: How a transition's wait for its GPUs' locks ended (proxy/sharing/gpu_lock.py WAIT_OUTCOMES).
GPU_LOCK_OUTCOMES: tuple[str, ...] = ("free", "waited", "busy", "unavailable")

_M = TypeVar("_M", Counter, Histogram, Gauge)


def _bind(parent: _M, engine: str, values: Iterable[str]) -> dict[str, _M]:
    """One pre-created child per label value: the hot path does a dict lookup, not ``labels()``."""
    return {value: parent.labels(engine, value) for value in values}


class Metrics:
    """Every series of one proxy on one injected registry: the families, the proxy's own series, and one
    ``EngineMetrics`` per engine (``engine(name)``).

    ``states`` is the state machine's state names, the first being the state at start-up; ``operations`` is
    the lifecycle operations the coordinators report. ``edges`` optionally narrows the pre-created
    ``from_state``/``to_state`` pairs to the machine's real transitions (default: every ordered pair).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        version: str,
        engines: Sequence[str],
        states: Sequence[str],
        operations: Sequence[str],
        edges: Iterable[tuple[str, str]] | None = None,
    ) -> None:
        self.registry = registry
        self.states = tuple(states)
        self.operations = tuple(operations)
        self.edges = tuple(edges) if edges is not None else tuple(itertools.permutations(self.states, 2))
        e = ["engine"]

        Info(
            "lifeguard_build",
            "Build of the running vllm-lifeguard proxy; constant 1, the version is in the label.",
            registry=registry,
        ).info({"version": version})
        self._proxy_errors = Counter(
            "lifeguard_proxy_errors",
            "Unexpected exceptions (bugs) the proxy caught, answered 503 proxy_error (or an SSE error event on a "
            "stream already started) and logged with their traceback, by where they were caught.",
            ["where"],
            registry=registry,
        )
        self._proxy_error_children = {where: self._proxy_errors.labels(where) for where in PROXY_ERROR_PLACES}

        # --- the authoritative state
        self.state = Enum(
            "lifeguard_state",
            "The proxy's authoritative engine state: 1 for the current state, 0 for every other; "
            "changes on each state-machine transition.",
            e,
            states=list(self.states),
            registry=registry,
        )
        self.state_entered = Gauge(
            "lifeguard_state_entered_timestamp_seconds",
            "Unix time at which the current lifeguard_state was entered; set on each transition.",
            e,
            registry=registry,
        )
        self.transitions = Counter(
            "lifeguard_state_transitions",
            "State-machine transitions taken, counted when the new state is entered.",
            [*e, "from_state", "to_state"],
            registry=registry,
        )

        # --- lifecycle operations
        self.operations_total = Counter(
            "lifeguard_lifecycle_operations",
            "Lifecycle calls (sleep, wake_up, pause ...) received, counted when answered, by outcome.",
            [*e, "operation", "outcome"],
            registry=registry,
        )
        self.operation_duration = Histogram(
            "lifeguard_lifecycle_operation_duration_seconds",
            "Wall time of a lifecycle call from arrival to answer (queueing, upstream call and "
            "verification included), observed when answered, whatever the outcome.",
            [*e, "operation"],
            buckets=LIFECYCLE_BUCKETS,
            registry=registry,
        )

        # --- held and in-flight inference requests
        self.held = Gauge(
            "lifeguard_held_requests",
            "Inference requests held by the proxy right now, waiting for the engine to be RUNNING.",
            e,
            registry=registry,
        )
        self.hold = Histogram(
            "lifeguard_hold_duration_seconds",
            "Time an inference request spent held, observed when it leaves the hold, by how it left.",
            [*e, "outcome"],
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        # The three series observed on every forwarded request: folded at read time (proxy/observe/request_metrics.py).
        self.inference = CounterFamily(
            "lifeguard_inference_requests",
            "Inference requests, counted once when they end, by outcome (forwarded or why not).",
            [*e, "outcome"],
            INFERENCE_OUTCOMES,
        )
        self.inflight = Gauge(
            "lifeguard_inflight_requests",
            "Inference requests forwarded to vLLM whose response has not finished yet.",
            e,
            registry=registry,
        )
        self.upstream_latency = HistogramFamily(
            "lifeguard_upstream_response_latency_seconds",
            "Time from sending a request to vLLM to receiving its response headers, observed per forwarded request.",
            e,
            REQUEST_BUCKETS,
        )
        self.request_duration = HistogramFamily(
            "lifeguard_request_duration_seconds",
            "Wall time of a request through the proxy, arrival to last byte (holding included), "
            "observed when it ends, by route class.",
            [*e, "route_class"],
            REQUEST_BUCKETS,
        )
        for family in (self.inference, self.upstream_latency, self.request_duration):
            registry.register(family)

        # --- verification: catching "200 lies"
        self.checks = Counter(
            "lifeguard_verification_checks",
            "Verification checks run after a lifecycle 200, by check and result.",
            [*e, "check", "result"],
            registry=registry,
        )
        self.lies = Counter(
            "lifeguard_lies_caught",
            'Lifecycle calls that vLLM answered 200 but verification proved untrue ("200 lies"), '
            "by operation and the check that caught it.",
            [*e, "operation", "check"],
            registry=registry,
        )
        self.drift = Counter(
            "lifeguard_drift_events",
            "Times reconciliation found vLLM's real state differing from the proxy's, counted when "
            "detected (someone called vLLM directly, or the engine changed on its own).",
            e,
            registry=registry,
        )
        self.restarts = Counter(
            "lifeguard_engine_restarts",
            "Times the engine was seen to have restarted (it came back awake and fresh after being "
            "unreachable or asleep), counted when detected.",
            e,
            registry=registry,
        )
        self.weights_stale = Gauge(
            "lifeguard_weights_stale",
            "1 while the engine's weights are known stale (after a level-2 sleep, a /weight_checker reset or a "
            "checksum mismatch, until weights are loaded again; after a restart, until a weight update), else 0.",
            e,
            registry=registry,
        )
        self.unchanged_updates = Counter(
            "lifeguard_weight_updates_unchanged",
            "Weight update sessions that finished with every weight checksum as before the session "
            "(weight_checksums: always).",
            e,
            registry=registry,
        )
        self.prefix_partitioned = Gauge(
            "lifeguard_prefix_cache_partitioned",
            "1 while vLLM's prefix cache may still hold blocks computed by weights older than the last weight "
            "change (its reset has not succeeded since), so admitted inference carries the proxy's cache_salt.",
            e,
            registry=registry,
        )
        self.stalled = Gauge(
            "lifeguard_engine_stalled",
            "1 while inference requests are in flight and vLLM has sent no byte for stall_after_s while RUNNING.",
            e,
            registry=registry,
        )
        self.versions = VersionFamilies(registry)
        self.prefix_resets = Counter(
            "lifeguard_prefix_cache_resets",
            "Answers of /reset_prefix_cache the proxy read, by who sent it (proxy, client) and what it said "
            "(cleared, not_cleared: vLLM's success false, unknown: an error or a body without success).",
            [*e, "by", "result"],
            registry=registry,
        )

        # --- GPU memory, as the engine's probe last read it
        self.gpu_used = Gauge(
            "lifeguard_gpu_memory_used_bytes",
            "GPU memory in use, as last read by the engine's probe (NVML or file): the device's, or the "
            "engine's own share where several engines share the device and the probe can tell.",
            [*e, "gpu"],
            registry=registry,
        )
        self.gpu_total = Gauge(
            "lifeguard_gpu_memory_total_bytes",
            "Total GPU memory of the device, as last read by the engine's probe.",
            [*e, "gpu"],
            registry=registry,
        )
        self.gpu_probe = Gauge(
            "lifeguard_gpu_probe_available",
            "1 if the engine's last GPU memory probe succeeded, 0 if there is no probe or it failed.",
            e,
            registry=registry,
        )

        # --- operating policies
        self.policies = Counter(
            "lifeguard_policy_actions",
            "Actions an operating policy took on its own (a wake on request, an idle sleep, a drain), "
            "counted when started.",
            [*e, "policy"],
            registry=registry,
        )

        # --- routes in no table (routes.RouteKind.UNKNOWN): the one label whose values are open, so bounded
        self.unknown_routes = Counter(
            "lifeguard_unknown_route_requests",
            "Requests to a route neither vLLM nor a supported trainer serves, forwarded at once "
            "(unknown_routes: pass), by method and path template (digits as {id}; past "
            f"{UNKNOWN_ROUTE_LABELS} templates per engine, 'other').",
            [*e, "method", "path"],
            registry=registry,
        )

        # --- swaps between engines sharing GPUs (proxy/sharing/arbiter.py)
        self._swaps = Counter(
            "lifeguard_swaps",
            "Wakes of a sleeping engine on shared GPUs through the arbiter (room made first), by how they ended.",
            [*e, "outcome"],
            registry=registry,
        )
        self._swap_durations = Histogram(
            "lifeguard_swap_duration_seconds",
            "From a swap's start to the engine awake and verified: its neighbour's turn, drain and sleep included.",
            e,
            buckets=LIFECYCLE_BUCKETS,
            registry=registry,
        )
        self._swap_waits = Histogram(
            "lifeguard_swap_wait_seconds",
            "How long the request that waited longest for a swap waited, from its arrival to its engine awake and "
            "verified, observed per swap asked for by held requests.",
            e,
            buckets=LIFECYCLE_BUCKETS,
            registry=registry,
        )

        # --- the GPU locks a transition that takes GPU memory holds (proxy/sharing/gpu_lock.py)
        self._gpu_lock_waits = Counter(
            "lifeguard_gpu_lock_waits",
            "Transitions that take GPU memory (wake, weight load, collective_rpc, KV release) and the GPU locks "
            "they waited for: this proxy's per GPU and, with gpu_lock_dir, the node's (another pod's lifeguard), "
            "by how the wait ended: free (at once), waited, busy (409 at the deadline), unavailable (503).",
            [*e, "outcome"],
            registry=registry,
        )
        self._gpu_lock_wait_seconds = Histogram(
            "lifeguard_gpu_lock_wait_seconds",
            "Time a transition that takes GPU memory waited for its GPUs' locks before it ran.",
            e,
            buckets=LIFECYCLE_BUCKETS,
            registry=registry,
        )

        self._engines = {name: EngineMetrics(self, name) for name in engines}

    def engine(self, name: str) -> EngineMetrics:
        """The series of engine ``name``, children bound."""
        return self._engines[name]

    def proxy_error(self, where: str) -> None:
        """A bug was caught at ``where`` (PROXY_ERROR_PLACES)."""
        self._proxy_error_children[where].inc()

    def swap_finished(self, engine: str, outcome: str, seconds: float, *, waited: float | None = None) -> None:
        """A swap of ``engine`` ended with ``outcome`` (SWAP_OUTCOMES) after ``seconds``; ``waited``: how long the
        request it was asked for by that waited longest had waited, when held requests asked for it."""
        series = self._engines[engine]
        series.swaps[outcome].inc()
        if outcome == "ok":
            series.swap_duration.observe(seconds)
            if waited is not None:
                series.swap_wait.observe(waited)

    def gpu_lock_waited(self, engine: str, outcome: str, seconds: float) -> None:
        """A transition of ``engine`` waited ``seconds`` for its GPUs' locks, ending ``outcome``
        (GPU_LOCK_OUTCOMES)."""
        self._engines[engine].gpu_lock_waited(outcome, seconds)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The registry as the scraper asked for it (Prometheus text or OpenMetrics), and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class EngineMetrics:
    """One engine's series, fed through one method per kind of event; children bound at construction."""

    def __init__(self, family: Metrics, engine: str) -> None:
        self.name = engine
        self._family = family
        self._state = family.state.labels(engine)
        self._state_entered = family.state_entered.labels(engine)
        self._state_entered.set_to_current_time()
        self._transitions = {(a, b): family.transitions.labels(engine, a, b) for a, b in family.edges}
        self._operations = {
            (op, outcome): family.operations_total.labels(engine, op, outcome)
            for op, outcome in itertools.product(family.operations, OPERATION_OUTCOMES)
        }
        self._operation_durations = _bind(family.operation_duration, engine, family.operations)
        self._held = family.held.labels(engine)
        self._holds = _bind(family.hold, engine, HOLD_OUTCOMES)
        self._inference = family.inference.counts(engine)
        self._inflight = family.inflight.labels(engine)
        self._upstream_latency = family.upstream_latency.labels(engine)
        self._request_durations = {route: family.request_duration.labels(engine, route) for route in ROUTE_CLASSES}
        self._checks = {
            (check, result): family.checks.labels(engine, check, result)
            for check, result in itertools.product(CHECKS, CHECK_RESULTS)
        }
        self._lies = {
            (op, check): family.lies.labels(engine, op, check)
            for op, check in itertools.product(family.operations, CHECKS)
        }
        self._drift = family.drift.labels(engine)
        self._restarts = family.restarts.labels(engine)
        self._weights_stale = family.weights_stale.labels(engine)
        self._unchanged_updates = family.unchanged_updates.labels(engine)
        self._prefix_partitioned = family.prefix_partitioned.labels(engine)
        self._stalled = family.stalled.labels(engine)
        self.versions = family.versions.bind(engine)
        self._prefix_resets = {
            (by, result): family.prefix_resets.labels(engine, by, result)
            for by, result in itertools.product(("proxy", "client"), ("cleared", "not_cleared", "unknown"))
        }
        self._gpu_probe = family.gpu_probe.labels(engine)
        self._policies = _bind(family.policies, engine, POLICIES)
        self._unknown_route_children: dict[tuple[str, str], Counter] = {}
        self.swaps = _bind(family._swaps, engine, SWAP_OUTCOMES)
        self.swap_duration = family._swap_durations.labels(engine)
        self.swap_wait = family._swap_waits.labels(engine)
        self._gpu_lock_waits = _bind(family._gpu_lock_waits, engine, GPU_LOCK_OUTCOMES)
        self._gpu_lock_wait_seconds = family._gpu_lock_wait_seconds.labels(engine)

    # --- state

    def state_changed(self, src: str, dst: str) -> None:
        """The state machine moved from ``src`` to ``dst``."""
        child = self._transitions.get((src, dst))
        if child is None:
            child = self._new_edge(src, dst)
        child.inc()
        self._state.state(dst)
        self._state_entered.set_to_current_time()

    def _new_edge(self, src: str, dst: str) -> Counter:
        unknown = {src, dst} - set(self._family.states)
        if unknown:
            raise KeyError(f"unknown state(s) {sorted(unknown)}")
        child = self._transitions[(src, dst)] = self._family.transitions.labels(self.name, src, dst)
        return child

    # --- lifecycle

    def operation_finished(self, operation: str, outcome: str, seconds: float) -> None:
        """A lifecycle call was answered (``outcome`` from OPERATION_OUTCOMES) after ``seconds``."""
        self._operations[(operation, outcome)].inc()
        self._operation_durations[operation].observe(seconds)

    # --- requests

    def watch_counts(self, held: Callable[[], int], inflight: Callable[[], int]) -> None:
        """Read the held and in-flight counts when scraped, instead of a locked set on every request."""
        self._held.set_function(held)
        self._inflight.set_function(inflight)

    def hold_finished(self, outcome: str, seconds: float) -> None:
        """A held request left the hold (``outcome`` from HOLD_OUTCOMES) after ``seconds``."""
        self._holds[outcome].observe(seconds)

    def inference_finished(self, outcome: str, seconds: float) -> None:
        """An inference request ended (``outcome`` from INFERENCE_OUTCOMES), ``seconds`` after it arrived."""
        self._inference[outcome] += 1
        self._request_durations["inference"].observe(seconds)

    def upstream_latency(self, seconds: float) -> None:
        """vLLM's response headers arrived ``seconds`` after the request was sent."""
        self._upstream_latency.observe(seconds)

    def request_duration(self, route_class: str, seconds: float) -> None:
        """A request of ``route_class`` (from ROUTE_CLASSES) finished after ``seconds``."""
        self._request_durations[route_class].observe(seconds)

    # --- verification and reconciliation

    def verification(self, check: str, result: str) -> None:
        """A verification ``check`` (CHECKS) ran with ``result`` (CHECK_RESULTS)."""
        self._checks[(check, result)].inc()

    def lie_caught(self, operation: str, check: str) -> None:
        """``operation`` answered 200 but ``check`` proved it untrue."""
        self._lies[(operation, check)].inc()

    def drift(self) -> None:
        """Reconciliation found vLLM's state differing from ours."""
        self._drift.inc()

    def engine_restart(self) -> None:
        """The engine was seen to have restarted."""
        self._restarts.inc()

    def weights_stale(self, stale: bool) -> None:
        """Whether the engine's weights are stale now."""
        self._weights_stale.set(1 if stale else 0)

    def weight_update_unchanged(self) -> None:
        """A weight update session finished without changing any weight's checksum."""
        self._unchanged_updates.inc()

    def prefix_partitioned(self, partitioned: bool) -> None:
        """Whether blocks computed by older weights may still be in vLLM's prefix cache."""
        self._prefix_partitioned.set(1 if partitioned else 0)

    def stalled(self, stalled: bool) -> None:
        """Whether requests are in flight and vLLM sent no byte for `stall_after_s`."""
        self._stalled.set(1 if stalled else 0)

    def prefix_reset(self, by: str, result: str) -> None:
        """An answer of /reset_prefix_cache sent by ``by`` (proxy, client) said ``result``."""
        self._prefix_resets[by, result].inc()

    def gpu_memory(self, gpu: str, used_bytes: int, total_bytes: int) -> None:
        """The probe read ``used_bytes`` of ``total_bytes`` on device ``gpu`` (its index or UUID)."""
        self._family.gpu_used.labels(self.name, gpu).set(used_bytes)
        self._family.gpu_total.labels(self.name, gpu).set(total_bytes)

    def gpu_probe_available(self, available: bool) -> None:
        """Whether the last GPU memory probe succeeded."""
        self._gpu_probe.set(1 if available else 0)

    def proxy_error(self, where: str) -> None:
        """A bug was caught at ``where`` while serving this engine (a series of the proxy's own)."""
        self._family.proxy_error(where)

    # --- routes and policies

    def unknown_route(self, method: str, template: str) -> None:
        key = (method if method in HTTP_METHODS else "other", template)
        child = self._unknown_route_children.get(key)
        if child is None:
            if len(self._unknown_route_children) >= UNKNOWN_ROUTE_LABELS:
                key = (key[0], "other")
            child = self._unknown_route_children.get(key)
            if child is None:
                child = self._unknown_route_children[key] = self._family.unknown_routes.labels(self.name, *key)
        child.inc()

    def gpu_lock_waited(self, outcome: str, seconds: float) -> None:
        """A transition waited ``seconds`` for its GPUs' locks and then ``outcome`` (GPU_LOCK_OUTCOMES):
        the time is observed when the locks were taken."""
        self._gpu_lock_waits[outcome].inc()
        if outcome in ("free", "waited"):
            self._gpu_lock_wait_seconds.observe(seconds)

    def policy_action(self, policy: str) -> None:
        """An operating ``policy`` (POLICIES) acted on its own."""
        self._policies[policy].inc()
