"""`GET /lifeguard/serving`: 200 while an inference request sent now would be forwarded at once, else 503 in
vLLM's error shape naming the state and the cause (one engine's: `Engine.serving_refusal`, from `rules.serving_refusal`,
which reads `admission` itself).

Readiness for routers (vllm-router's `--health-check-endpoint`, a Kubernetes readinessProbe, and through Pod
Ready every Service, EPP and Gateway): `/lifeguard/readyz` says "accepting" (serve or hold), this says "serving
now". It is answered from the proxy's own state, with no call to vLLM, and is never held. Pure: a front asks
for the answer and writes it, a dict as a 200 JSON body or the `NotServing` error as any error it renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import NotServing

SERVING: dict[str, Any] = {"serving": True, "state": "RUNNING"}


def engines_answer(refusals: Mapping[str, NotServing | None]) -> dict[str, Any] | NotServing:
    """Several engines behind one port: serving while any of them is, with each engine's answer beside it."""
    engines = {name: SERVING if refusal is None else _refused(refusal) for name, refusal in refusals.items()}
    if any(refusal is None for refusal in refusals.values()):
        return {"serving": True, "engines": engines}
    causes = ", ".join(f"{name} ({summary['cause']})" for name, summary in engines.items())
    return NotServing(f"no engine can serve now: {causes}", engines=engines)


def _refused(refusal: NotServing) -> dict[str, Any]:
    return {"serving": False, **refusal.details, "message": refusal.message}
