"""vLLM's Prometheus text for the series the proxy and its dashboards read."""

from __future__ import annotations

from lifeguard_sim.engine import Engine

_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_REASONS = ("stop", "length", "abort", "error", "repetition")


def render(engine: Engine) -> str:
    model = engine.settings.model
    base = f'engine="0",model_name="{model}"'
    sched = engine.scheduler
    lines = [
        "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; "
        "awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; "
        "discard_all = 1 means sleep level 2.",
        "# TYPE vllm:engine_sleep_state gauge",
    ]
    for label, value in zip(("awake", "weights_offloaded", "discard_all"), engine.sleep_metric, strict=True):
        lines.append(f'vllm:engine_sleep_state{{{base},sleep_state="{label}"}} {float(value)}')
    lines += _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", base, sched.running)
    lines += _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", base, sched.waiting)
    lines += [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in _REASONS:
        count = float(sched.stats.finished[reason])
        lines.append(f'vllm:request_success_total{{{base},finished_reason="{reason}"}} {count}')
    lines += _counter(
        "vllm:generation_tokens_total", "Number of generation tokens processed.", base, sched.stats.generation_tokens
    )
    lines += _counter(
        "vllm:prompt_tokens_total", "Number of prefill tokens processed.", base, sched.stats.prompt_tokens
    )
    lines += [
        "# HELP vllm:sleep_mode_operation_duration_seconds Duration of sleep mode operations.",
        "# TYPE vllm:sleep_mode_operation_duration_seconds histogram",
    ]
    for operation, samples in sched.stats.durations.items():
        lines += _histogram("vllm:sleep_mode_operation_duration_seconds", f'operation="{operation}"', samples)
    return "\n".join(lines) + "\n"


def _gauge(name: str, doc: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]


def _counter(name: str, doc: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name}{{{labels}}} {float(value)}"]


def _histogram(name: str, labels: str, samples: list[float]) -> list[str]:
    out = []
    for bound in _BUCKETS:
        count = sum(1 for s in samples if s <= bound)
        out.append(f'{name}_bucket{{le="{bound}",{labels}}} {float(count)}')
    out.append(f'{name}_bucket{{le="+Inf",{labels}}} {float(len(samples))}')
    out.append(f"{name}_count{{{labels}}} {float(len(samples))}")
    out.append(f"{name}_sum{{{labels}}} {sum(samples)}")
    return out
