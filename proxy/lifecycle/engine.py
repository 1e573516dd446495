"""`Engine`: one guarded vLLM, the unit the proxy is made of.

A single `upstream:` is one engine (named `default`); `engines:` is several, each guarded the same way.
An engine has its own coordinator (and with it its record, verifier and rules), request gate, in-flight
requests, policies, reconcile loop, GPU footprint and pool of connections to its vLLM. It knows nothing of
the others: several engines meet only in the arbiter (proxy/sharing/arbiter.py) and the front
(proxy/front/dispatcher.py).

It is the one door of its lifecycle: the front and the arbiter ask it (admit a request, hold it, what its body
carries, plan and run a control call, the serving refusal, the view of the state) and never reach its parts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from ..config import EngineSettings, Settings
from ..errors import LifeguardError, NotServing
from ..gpu.footprint import Footprint
from ..gpu.readers import GpuMemoryReader, GpuReading
from ..observe.metrics import EngineMetrics
from ..observe.unknown_routes import UnknownRoutes
from ..tasks import Tasks
from ..upstream.forwarding import Upstream
from ..upstream.refusals import Refusal
from ..upstream.vllm_client import VllmClient
from .coordinator import LifecycleCoordinator, SubmitGuard
from .coordinator import Submit as Submit  # the arbiter's vocabulary
from .gate import Parked, ParkedOwner, RequestGate, Ticket
from .inflight import InFlightRequests
from .offload_tier import emptying_both_tiers, tier_kept_by
from .outcome import Outcome
from .parsed_calls import LifecycleCall, parse_call
from .policies import Policies
from .prefix_cache import LORA_LOAD_PATH, RESET_PATH, SALTED_PATHS, reloaded_adapter, salted
from .reconcile import reconcile_loop, stall_loop
from .rules import EngineView, control_refusal, serving_refusal
from .states import State
from .verifier import Verifier
from .weight_checksums import resets_weights
from .weight_version import RELABEL_PATH, WEIGHT_INFO_PATH

T = TypeVar("T")


@dataclass(frozen=True)
class ControlPlan:
    """How one control call is forwarded: what its answer is told (`on_answer`, which may rewrite the body), and
    whether it sets every weight to zero (the coordinator marks the weights so before it is sent)."""

    on_answer: Callable[[int, bytes], bytes | None] | None = None
    zeroes_weights: bool = False
    rewrite: Callable[[int, bytes], bytes | None] | None = None  # the body the client gets instead of vLLM's
    target: bytes | None = None  # what is sent instead of the client's target (None: the client's)


_FORWARD_AS_IS = ControlPlan()


class Engine:
    def __init__(
        self,
        settings: Settings,
        config: EngineSettings,
        *,
        metrics: EngineMetrics,
        gpu: GpuMemoryReader,
        session: aiohttp.ClientSession,
    ) -> None:
        """`settings`: the proxy's, as `Settings.for_engine(config)` made them for this engine."""
        self.name = config.name
        self.config = config
        self.settings = settings
        self.metrics = metrics
        self.footprint = Footprint(config.footprint_gib)
        self.client = VllmClient(session, config.upstream, control_timeout_s=settings.control_call_timeout_s)
        self.verifier = Verifier(
            self.client,
            gpu,
            settings,
            footprint=self.footprint,
            on_check=metrics.verification,
            on_memory=self._report_memory,
        )
        self.gate = RequestGate(
            max_held=settings.max_held_requests,
            max_held_bytes=settings.max_held_bytes,
            hold_timeout_s=settings.hold_timeout_s,
            on_hold_ended=metrics.hold_finished,
        )
        metrics.watch_counts(lambda: self.gate.held, lambda: self.gate.inflight)
        # An inference request admitted now (its ticket counts it in flight until `done()`), else None: hold it.
        # The gate's own method, so that the door adds no call on the data plane's path.
        self.admit: Callable[[], Ticket | None] = self.gate.try_admit
        self.tasks = Tasks()
        self.inflight = InFlightRequests()
        self.coordinator = LifecycleCoordinator(settings, self.client, self.verifier, self.gate, metrics, self.tasks,
                                                self.inflight)  # fmt: skip
        # The weight version the proxy vouches for: every inference answer names it (front/versioned.py).
        self.versions = self.coordinator.versions
        self.policies = Policies(settings, self.coordinator, self.gate, metrics)
        self.gate.on_held_while_sleeping = self.policies.request_held_while_sleeping
        self.unknown_routes = UnknownRoutes(metrics)
        self.upstream = Upstream(
            config.upstream,
            shown=settings.upstream_shown,
            max_connections=settings.upstream_max_connections,
            max_connecting=settings.upstream_max_connecting,
            keepalive_s=settings.upstream_keepalive_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
        self._stop = asyncio.Event()
        self._vllm_version: str | None = None

    def start(self) -> None:
        """Start the reconcile loop (it finds out what the engine is, then keeps watching), and the stall watch."""
        interval = self.settings.reconcile_interval_s
        self.tasks.spawn(reconcile_loop(self.coordinator, self.policies, interval, self._stop),
                         name=f"reconcile:{self.name}")  # fmt: skip
        if self.settings.stall_after_s is not None:
            self.tasks.spawn(stall_loop(self.coordinator, interval, self._stop), name=f"stall:{self.name}")

    def stop_admitting(self) -> None:
        """Shutdown, first step: held requests are answered 503 `shutting_down`, new ones refused."""
        self.coordinator.close()

    async def close(self) -> None:
        """Shutdown, last step: the reconcile loop and any lifecycle call or policy action still running end,
        then the connections to vLLM close."""
        self._stop.set()
        await self.tasks.close()
        await self.upstream.pool.close()

    # ----- the door: what the front asks of a request for this engine
    def hold(self, owner: ParkedOwner, size: int) -> Parked:
        """An inference request the gate holds, its `size` bytes parked, until `owner` is admitted or refused."""
        return self.gate.park(owner, size)

    @property
    def weights_stale(self) -> bool:
        """Whether an answer carries `X-Lifeguard-Weights-Stale` (a restarted proxy cannot vouch for the weights).
        Read once per admitted request: from the record, without another call."""
        return self.coordinator.record.weights_stale is not None

    def body_to_send(self, path: str, body: bytes) -> bytes:
        """An admitted inference request's body as vLLM gets it: salted apart from the prefix cache that older
        weights filled (lifecycle/prefix_cache.py), read when it is sent."""
        partition = self.coordinator.record.prefix_partition
        if partition is not None and path in SALTED_PATHS:
            return salted(body, partition.salt)
        return body

    async def refused_by_vllm(self, refusal: Refusal) -> None:
        """vLLM refused a forwarded request for its own state: that state is read and adopted, so that the request,
        admitted again, is held, refused or forwarded by what the engine now is."""
        await self.coordinator.engine_refused(refusal)

    def plan_at_once(self, path: str, target: bytes, body: bytes) -> ControlPlan:
        """A control call forwarded at once; raises the LifeguardError that refuses it while the engine cannot. A
        client's prefix-cache reset sent while old-weight blocks may be cached empties the offload tier too; a
        relabel's answer says whether the weights changed since the last label."""
        if (refusal := control_refusal(self.coordinator.record.view())) is not None:
            raise refusal
        if path == RELABEL_PATH:
            return ControlPlan(self.versions.relabel_answered(body))
        if path != RESET_PATH:
            return _FORWARD_AS_IS
        if self.coordinator.record.prefix_partition is None:
            return ControlPlan(self.coordinator.client_reset_answered)
        answered = functools.partial(self.coordinator.client_reset_answered, tier_kept=tier_kept_by(target))
        return ControlPlan(answered, target=emptying_both_tiers(target))

    def plan_read(self, path: str) -> ControlPlan:
        """A read forwarded in every state: `/weight_info` answers with the version the proxy vouches for (vLLM's own
        label is wrong after a restart, a reload, a relabel behind the proxy's back or a failed chunk)."""
        return ControlPlan(rewrite=self.versions.info_answered) if path == WEIGHT_INFO_PATH else _FORWARD_AS_IS

    def plan_serialized(self, path: str, body: bytes) -> ControlPlan:
        """A control call that touches weights or memory, run by `exclusive`: a LoRA adapter loaded again is
        checked as the one it replaces; a reset of the weights is said before it is sent."""
        adapter = reloaded_adapter(body) if path == LORA_LOAD_PATH else None
        on_answer = self.coordinator.adapter_reload_answered(adapter) if adapter is not None else None
        return ControlPlan(on_answer, resets_weights(path, body))

    async def exclusive(self, work: Callable[[], Awaitable[T]], plan: ControlPlan) -> T:
        """Run `work` (the forwarded call of `plan_serialized`) once no lifecycle transition is in progress."""
        return await self.coordinator.exclusive(work, zeroes_weights=plan.zeroes_weights)

    async def run_call(self, op: str, query: Iterable[tuple[str, str]], body: bytes) -> Outcome:
        """A lifecycle call, parsed (a bad parameter raises BadParameter, counted `invalid`) and run by the
        coordinator, serialized with every other; raises the LifeguardError that answers it on failure."""
        try:
            call = parse_call(op, query, body)
        except LifeguardError:
            self.metrics.operation_finished(op, "invalid", 0.0)
            raise
        return await self.coordinator.submit(call)

    # ----- the door: what the arbiter asks (proxy/sharing/arbiter.py)
    def guard_with(self, guard: SubmitGuard) -> None:
        """From now on every lifecycle call of this engine goes through `guard` first (several engines share GPUs)."""
        self.coordinator.guard = guard

    async def submit_unguarded(self, call: LifecycleCall) -> Outcome:
        """A lifecycle call the guard itself makes (a sleep to make room, a reload after a wake)."""
        return await self.coordinator.submit_unguarded(call)

    def swap_out(self, for_engine: str | None) -> None:
        """Hold new requests while this engine is drained for `for_engine`'s turn; None: admit them again."""
        self.coordinator.swap_out(for_engine)

    def next_state_change(self) -> asyncio.Event:
        """An event set at the engine's next change of state."""
        return self.coordinator.record.next_state_change()

    async def vllm_version(self) -> str | None:
        """vLLM's `/version`, read once it answers; None until then."""
        if self._vllm_version is None:
            try:
                reply = await self.client.call("GET", "/version")
                version = reply.json().get("version") if reply.status == 200 else None
            except (LifeguardError, ValueError, AttributeError):
                return None
            self._vllm_version = version if isinstance(version, str) else None
        return self._vllm_version

    async def read_memory(self) -> GpuReading:
        """The GPUs' memory as this engine's own reader sees it now."""
        return await self.verifier.read_memory()

    @property
    def requests_held(self) -> int:
        return self.gate.held

    @property
    def requests_in_flight(self) -> int:
        return self.gate.inflight

    @property
    def oldest_held_since(self) -> float | None:
        """When the request held longest arrived (time.monotonic()), if any is held."""
        return self.gate.oldest_held_since

    @property
    def last_activity(self) -> float:
        """When a request last came to the gate (time.monotonic())."""
        return self.gate.last_activity

    def refuse_held(self, error: LifeguardError) -> None:
        """Answer every held request `error` now (a wake that cannot happen); new requests are admitted as before."""
        self.gate.refuse_held(error)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight, at most `timeout_s`; returns whether it became idle."""
        return await self.gate.wait_idle(timeout_s)

    def spawn(self, work: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run `work` as one of this engine's tasks: it ends, at the latest, when the engine closes."""
        return self.tasks.spawn(work, name=name)

    @property
    def asleep_holding_memory(self) -> bool:
        """Asleep by vLLM's flags, unconfirmed, and the last reading shows the awake footprint still there. A sleep
        known from vLLM's gauge alone is unconfirmed too; only such a reading says it kept its memory (else every
        engine found asleep at the proxy's start would)."""
        last = self.verifier.last_memory
        return self.view().sleep_unconfirmed and last is not None and self.verifier.memory_freed(last) is False

    # ----- the door: what it is now
    @property
    def state(self) -> State:
        return self.coordinator.state

    def view(self) -> EngineView:
        """What the proxy holds true about the engine now (a value, for answers and decisions outside)."""
        return self.coordinator.record.view()

    def serving_refusal(self) -> NotServing | None:
        """Why an inference request sent now would not be forwarded at once, if it would not: `/lifeguard/serving`
        for this engine (proxy/front/readiness.py)."""
        return serving_refusal(
            self.view(),
            on_sleeping=self.settings.on_sleeping,
            hold_while_restarted=self.settings.hold_while_weights_stale,
            closed=self.gate.closed,
        )

    @property
    def state_name(self) -> str:
        """Its state for readiness: the coordinator's, or `closed` once it stopped admitting (shutdown)."""
        return "closed" if self.gate.closed else self.coordinator.state.value

    def snapshot(self) -> dict[str, Any]:
        """`/engines/<name>/lifeguard/state`: the coordinator's view and how this engine is configured."""
        return {
            **self.coordinator.snapshot(),
            "name": self.name,
            "gpus": list(self.config.gpus),
            "pinned": self.config.pinned,
            "swap_sleep_level": self.config.swap_sleep_level,
            "footprint_bytes": self.footprint.bytes,
            "base_url": f"/engines/{self.name}/",
        }

    def _report_memory(self, reading: GpuReading) -> None:
        self.metrics.gpu_probe_available(reading.available)
        for device in reading.devices:
            self.metrics.gpu_memory(device.gpu, device.used_bytes, device.total_bytes)
