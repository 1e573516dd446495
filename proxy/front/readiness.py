"""`GET /lifeguard/serving`: 200 while an inference request sent now would be forwarded at once, else 503 in
vLLM's error shape naming the state and the cause (`rules.serving_refusal`, which reads `admission` itself).

Readiness for routers (vllm-router's `--health-check-endpoint`, a Kubernetes readinessProbe, and through Pod
Ready every Service, EPP and Gateway): `/lifeguard/readyz` says "accepting" (serve or hold), this says "serving
now". It is answered from the proxy's own state, with no call to vLLM, and is never held. Pure: a front asks
for the answer and writes it, a dict as a 200 JSON body or the `NotServing` error as any error it renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..errors import NotServing
from ..lifecycle.rules import serving_refusal

if TYPE_CHECKING:
    from ..lifecycle.coordinator import LifecycleCoordinator
    from ..lifecycle.gate import RequestGate

SERVING: dict[str, Any] = {"serving": True, "state": "RUNNING"}


def engine_refusal(coordinator: LifecycleCoordinator, gate: RequestGate, settings: Settings) -> NotServing | None:
    """Why this engine is not serving now, if it is not: the answer of `/lifeguard/serving` for one engine
    (a single-engine proxy, or `/engines/<name>/lifeguard/serving`)."""
    return serving_refusal(
        coordinator.record.view(),
        on_sleeping=settings.on_sleeping,
        hold_while_restarted=settings.hold_while_weights_stale,
        closed=gate.closed,
    )


def engines_answer(refusals: Mapping[str, NotServing | None]) -> dict[str, Any] | NotServing:
    """Several engines behind one port: serving while any of them is, with each engine's answer beside it."""
    engines = {name: SERVING if refusal is None else _refused(refusal) for name, refusal in refusals.items()}
    if any(refusal is None for refusal in refusals.values()):
        return {"serving": True, "engines": engines}
    causes = ", ".join(f"{name} ({summary['cause']})" for name, summary in engines.items())
    return NotServing(f"no engine can serve now: {causes}", engines=engines)


def _refused(refusal: NotServing) -> dict[str, Any]:
    return {"serving": False, **refusal.details, "message": refusal.message}
