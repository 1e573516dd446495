"""Generate lifeguard-dashboard.json and configmap.yaml with grafana-foundation-sdk.

Regenerate after editing (the generated files are checked in; nothing else needs the SDK):

    python3 -m venv /tmp/gf && /tmp/gf/bin/pip install 'grafana-foundation-sdk==1769699379!11.6.0' pyyaml
    /tmp/gf/bin/python deploy/grafana/dashboard.py

The version is pinned with its epoch on purpose: a plain `pip install grafana-foundation-sdk`
resolves to an SDK for Grafana 10.1 (the epoch sorts first), and `==11.6.0` alone is unsatisfiable.

Every query uses the selector `{namespace=~"$namespace", pod=~"$pod", engine=~"$engine"}`. `namespace` and
`pod` come from the scrape (Kubernetes service discovery or the static labels of tests/observability), not
the proxy. `engine` is the proxy's own label, on every series about an engine (a single `upstream:` is
`engine="default"`); the variable's All value `.*` also keeps series without it.
tests/observability evaluates every `expr` below against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

HERE = Path(__file__).resolve().parent
UID = "vllm-lifeguard"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", pod=~"$pod", engine=~"$engine"'
RATE = "$__rate_interval"

# Codes for the state timelines: one number per state so one row per pod can be coloured by state.
LIFEGUARD_STATES = [
    ("STARTING", "blue"),
    ("RUNNING", "green"),
    ("PAUSING", "light-yellow"),
    ("PAUSED", "yellow"),
    ("RESUMING", "light-green"),
    ("FALLING_ASLEEP", "light-purple"),
    ("SLEEPING", "purple"),
    ("WAKING", "light-blue"),
    ("UPDATING_WEIGHTS", "orange"),
    ("SCALING", "dark-orange"),
    ("PREPARING_CHECKPOINT", "light-blue"),
    ("CHECKPOINTED", "semi-dark-blue"),
    ("RESTORING", "light-blue"),
    ("FAILED", "red"),
]
VLLM_SLEEP_STATES = [("awake", "green"), ("weights_offloaded", "purple"), ("discard_all", "dark-purple")]


def coded(metric: str, label: str, states: list[tuple[str, str]]) -> str:
    """`1*[state 1 active] + 2*[state 2 active] + ...` per pod and engine: the active state's code."""
    terms = [
        f'{code} * max by (namespace, pod, engine) ({metric}{{{SEL}, {label}="{name}"}})'
        for code, (name, _) in enumerate(states, start=1)
    ]
    return "\n+ ".join(terms)


def mappings(states: list[tuple[str, str]]) -> list[dm.ValueMap]:
    return [
        dm.ValueMap(
            options={
                str(code): dm.ValueMappingResult(text=name, color=color, index=code - 1)
                for code, (name, color) in enumerate(states, start=1)
            }
        )
    ]


def q(expr: str, legend: str, ref: str = "A") -> pb.Dataquery:
    return pb.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def legend() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode.TABLE)
        .placement(cm.LegendPlacement.RIGHT)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def series(title: str, description: str, unit: str, *targets: pb.Dataquery) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .min(0)
        .height(8)
        .span(12)
        .legend(legend())
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def quantiles(metric: str, by: str, legend_prefix: str) -> list[pb.Dataquery]:
    """p50 (ref A) and p99 (ref B) of histogram `metric`, per pod and the labels in `by`."""
    return [
        q(
            f"histogram_quantile({quantile}, sum by (namespace, pod, {by}le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"{legend_prefix} p{int(quantile * 100)}",
            ref,
        )
        for quantile, ref in ((0.5, "A"), (0.99, "B"))
    ]


def build() -> dict[str, object]:
    dash = (
        db.Dashboard("vLLM lifeguard: lifecycle")
        .uid(UID)
        .description(
            "The vLLM lifecycle as the lifeguard sidecar sees it: states, lifecycle calls, held "
            "requests, verification, GPU memory and traffic through the proxy."
        )
        .tags(["vllm", "lifeguard", "rl"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .editable()
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DS)
            .query("label_values(lifeguard_build_info, namespace)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        .with_variable(
            db.QueryVariable("pod")
            .label("Pod")
            .datasource(DS)
            .query('label_values(lifeguard_build_info{namespace=~"$namespace"}, pod)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        .with_variable(
            db.QueryVariable("engine")
            .label("Engine")
            .datasource(DS)
            .query('label_values(lifeguard_state{namespace=~"$namespace", pod=~"$pod"}, engine)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            # Not the list of values: `.*` also keeps the proxy's own series, which have no engine label.
            .all_value(".*")
        )
    )

    # --- Row 1: state at a glance
    dash = dash.with_row(db.Row("State"))
    dash = dash.with_panel(
        statetimeline.Panel()
        .title("Lifeguard state per pod")
        .description(
            "The proxy's authoritative state of each engine (lifeguard_state), one row per pod and engine. "
            "Green RUNNING serves; purple SLEEPING holds; red FAILED rejects."
        )
        .datasource(DS)
        .with_target(q(coded("lifeguard_state", "lifeguard_state", LIFEGUARD_STATES), "{{pod}} {{engine}}"))
        .mappings(mappings(LIFEGUARD_STATES))
        .show_value(cm.VisibilityMode.NEVER)
        .merge_values(True)
        .height(8)
        .span(16)
    )
    dash = dash.with_panel(
        stat.Panel()
        .title("Time in current state")
        .description("Seconds since each pod entered its current lifeguard_state.")
        .datasource(DS)
        .with_target(
            q(
                f"time() - max by (namespace, pod, engine) (lifeguard_state_entered_timestamp_seconds{{{SEL}}})",
                "{{pod}} {{engine}}",
            )
        )
        .unit("s")
        .height(8)
        .span(8)
    )
    dash = dash.with_panel(
        statetimeline.Panel()
        .title("vLLM engine sleep state per pod")
        .description(
            "vLLM's own vllm:engine_sleep_state (scraped through the proxy's /metrics passthrough), "
            "to compare with the lifeguard state above: they should agree once an operation settles."
        )
        .datasource(DS)
        .with_target(q(coded("vllm:engine_sleep_state", "sleep_state", VLLM_SLEEP_STATES), "{{pod}}"))
        .mappings(mappings(VLLM_SLEEP_STATES))
        .show_value(cm.VisibilityMode.NEVER)
        .merge_values(True)
        .height(6)
        .span(16)
    )
    dash = dash.with_panel(
        stat.Panel()
        .title("Weights stale")
        .description(
            "1 while a pod's weights are known stale (after a level-2 sleep or an engine restart, "
            "until weights are loaded again)."
        )
        .datasource(DS)
        .with_target(q(f"max by (namespace, pod, engine) (lifeguard_weights_stale{{{SEL}}})", "{{pod}} {{engine}}"))
        .mappings(
            [
                dm.ValueMap(
                    options={
                        "0": dm.ValueMappingResult(text="fresh", color="green", index=0),
                        "1": dm.ValueMappingResult(text="STALE", color="red", index=1),
                    }
                )
            ]
        )
        .height(6)
        .span(8)
    )

    # --- Row 2: lifecycle operations
    dash = dash.with_row(db.Row("Lifecycle operations"))
    dash = dash.with_panel(
        series(
            "Lifecycle operation duration (p50 / p99)",
            "Time from a lifecycle call's arrival to its answer (queueing, vLLM's call and "
            "verification), by operation. Wakes with CUDA graph capture take many seconds.",
            "s",
            *quantiles("lifeguard_lifecycle_operation_duration_seconds", "operation, ", "{{pod}} {{operation}}"),
        )
    )
    dash = dash.with_panel(
        series(
            "Lifecycle operations by outcome",
            "Lifecycle calls answered per second, by operation and outcome (ok, noop, joined, invalid, "
            "refused, busy, unauthorized, upstream_error, verification_failed). Zero series hidden.",
            "reqps",
            q(
                f"sum by (namespace, pod, operation, outcome) "
                f"(rate(lifeguard_lifecycle_operations_total{{{SEL}}}[{RATE}])) > 0",
                "{{pod}} {{operation}} {{outcome}}",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            '"200 lies" caught',
            "Lifecycle calls vLLM answered 200 that verification proved untrue, by operation and the "
            "check that caught them (increase over the interval). Each one was answered 503.",
            "short",
            q(
                f"sum by (namespace, pod, operation, check) (increase(lifeguard_lies_caught_total{{{SEL}}}[{RATE}]))",
                "{{pod}} {{operation}} caught by {{check}}",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "Verification checks",
            "Checks run after each lifecycle 200 (flags, health, memory, canary), per second, by "
            "result. 'unavailable' means the check could not run (e.g. no GPU probe).",
            "ops",
            q(
                f"sum by (namespace, pod, check, result) "
                f"(rate(lifeguard_verification_checks_total{{{SEL}}}[{RATE}])) > 0",
                "{{pod}} {{check}} {{result}}",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "Drift, engine restarts and policy actions",
            "Drift: reconciliation found vLLM in a state the proxy did not put it in (a call that "
            "bypassed the proxy). Restarts: the engine came back fresh. Policy actions: wakes on "
            "request, idle sleeps, drains. Increase over the interval.",
            "short",
            q(
                f"sum by (namespace, pod) (increase(lifeguard_drift_events_total{{{SEL}}}[{RATE}]))",
                "{{pod}} drift",
                "A",
            ),
            q(
                f"sum by (namespace, pod) (increase(lifeguard_engine_restarts_total{{{SEL}}}[{RATE}]))",
                "{{pod}} engine restarts",
                "B",
            ),
            q(
                f"sum by (namespace, pod, policy) (increase(lifeguard_policy_actions_total{{{SEL}}}[{RATE}]))",
                "{{pod}} {{policy}}",
                "C",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "State transitions",
            "State-machine transitions per interval, by from and to state. Zero series hidden.",
            "short",
            q(
                f"sum by (namespace, pod, from_state, to_state) "
                f"(increase(lifeguard_state_transitions_total{{{SEL}}}[{RATE}])) > 0",
                "{{pod}} {{from_state}} → {{to_state}}",
            ),
        )
    )

    # --- Row 2b: model swaps between engines on shared GPUs (engines:, docs/model-swap.md)
    dash = dash.with_row(db.Row("Model swaps"))
    dash = dash.with_panel(
        series(
            "Swaps by outcome",
            "Wakes of a sleeping engine on shared GPUs through the arbiter, per second, by engine and how "
            "they ended: ok, no_room (503 insufficient_gpu_memory: it could not fit), failed. Zero series "
            "hidden. Only proxies with several engines have these series.",
            "ops",
            q(
                f"sum by (namespace, pod, engine, outcome) (rate(lifeguard_swaps_total{{{SEL}}}[{RATE}])) > 0",
                "{{pod}} {{engine}} {{outcome}}",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "Swap duration (p50 / p99)",
            "From a swap's start to the engine awake and verified: the neighbour's turn, drain and sleep "
            "included, by engine swapped in.",
            "s",
            *quantiles("lifeguard_swap_duration_seconds", "engine, ", "{{pod}} {{engine}}"),
        )
    )
    dash = dash.with_panel(
        series(
            "Swap wait (p50 / p99)",
            "How long the request that waited longest for a swap waited, from its arrival to its engine awake "
            "and verified: its neighbour's turn (swap_quantum_s), drain and the swap, by engine swapped in.",
            "s",
            *quantiles("lifeguard_swap_wait_seconds", "engine, ", "{{pod}} {{engine}}"),
        )
    )
    dash = dash.with_panel(
        series(
            "Swaps per minute",
            "Verified swaps per minute, by engine swapped in: how often engines change places (each costs a "
            "sleep and a wake; turns batch requests to keep this low).",
            "short",
            q(
                f'sum by (namespace, pod, engine) (rate(lifeguard_swaps_total{{{SEL}, outcome="ok"}}[{RATE}])) * 60',
                "{{pod}} {{engine}}",
            ),
        )
    )

    # --- Row 3: requests held and rejected
    dash = dash.with_row(db.Row("Held and rejected requests"))
    dash = dash.with_panel(
        series(
            "Held and in-flight requests",
            "Held: inference requests waiting for the engine to be RUNNING (during sleep, wake, pause, "
            "weight updates). In flight: forwarded to vLLM and not finished.",
            "short",
            q(f"sum by (namespace, pod) (lifeguard_held_requests{{{SEL}}})", "{{pod}} held", "A"),
            q(f"sum by (namespace, pod) (lifeguard_inflight_requests{{{SEL}}})", "{{pod}} in flight", "B"),
        )
    )
    dash = dash.with_panel(
        series(
            "Hold time (p50 / p99) by outcome",
            "How long held requests waited, by how they left the hold: forwarded, client_gone, "
            "hold_timeout, hold_queue_full, shutting_down, engine_unavailable.",
            "s",
            *quantiles("lifeguard_hold_duration_seconds", "outcome, ", "{{pod}} {{outcome}}"),
        )
    )
    dash = dash.with_panel(
        series(
            "Rejections by reason",
            "Inference requests that ended without being served, by outcome, and lifecycle calls "
            "turned away (invalid, refused, busy, unauthorized), per second. Zero series hidden.",
            "reqps",
            q(
                f"sum by (namespace, pod, outcome) (rate(lifeguard_inference_requests_total{{{SEL}, "
                f'outcome!="forwarded"}}[{RATE}])) > 0',
                "{{pod}} inference {{outcome}}",
                "A",
            ),
            q(
                f"sum by (namespace, pod, outcome) (rate(lifeguard_lifecycle_operations_total{{{SEL}, "
                f'outcome=~"invalid|refused|busy|unauthorized"}}[{RATE}])) > 0',
                "{{pod}} lifecycle {{outcome}}",
                "B",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "Inference requests by outcome",
            "Inference requests per second, counted when they end, by outcome (forwarded, or the "
            "reason they were not served).",
            "reqps",
            q(
                f"sum by (namespace, pod, outcome) (rate(lifeguard_inference_requests_total{{{SEL}}}[{RATE}])) > 0",
                "{{pod}} {{outcome}}",
            ),
        )
    )

    # --- Row 4: GPU memory next to vLLM's sleep state
    dash = dash.with_row(db.Row("GPU memory"))
    dash = dash.with_panel(
        series(
            "GPU memory used / total",
            "GPU memory per device as the proxy's probe (NVML, or the simulator's file) last read it. "
            "Sleep should free most of it, wake restore it; the sleep state is beside.",
            "bytes",
            q(
                f"max by (namespace, pod, gpu) (lifeguard_gpu_memory_used_bytes{{{SEL}}})",
                "{{pod}} gpu {{gpu}} used",
                "A",
            ),
            q(
                f"max by (namespace, pod, gpu) (lifeguard_gpu_memory_total_bytes{{{SEL}}})",
                "{{pod}} gpu {{gpu}} total",
                "B",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "vLLM sleep state and GPU probe",
            "vllm:engine_sleep_state by sleep_state (1 = current), from vLLM's own /metrics, and "
            "whether the proxy's GPU probe works (1) or not (0).",
            "short",
            q(
                f"max by (namespace, pod, sleep_state) (vllm:engine_sleep_state{{{SEL}}})",
                "{{pod}} vLLM {{sleep_state}}",
                "A",
            ),
            q(f"max by (namespace, pod) (lifeguard_gpu_probe_available{{{SEL}}})", "{{pod}} GPU probe", "B"),
        )
    )

    # --- Row 5: the proxy itself
    dash = dash.with_row(db.Row("Proxy traffic"))
    dash = dash.with_panel(
        series(
            "Proxy request rate by route class",
            "Requests through the proxy per second, by class: inference, lifecycle, passthrough "
            "(health, models, metrics ...); the proxy's own /lifeguard/ answers are not counted.",
            "reqps",
            q(
                f"sum by (namespace, pod, route_class) "
                f"(rate(lifeguard_request_duration_seconds_count{{{SEL}}}[{RATE}]))",
                "{{pod}} {{route_class}}",
            ),
        )
    )
    dash = dash.with_panel(
        series(
            "Proxy request latency (p50 / p99) and vLLM time to headers (p99)",
            "Arrival to last byte through the proxy, holding included, by route class; and the p99 "
            "time vLLM took to send response headers, which is what the proxy adds on top of.",
            "s",
            *quantiles("lifeguard_request_duration_seconds", "route_class, ", "{{pod}} {{route_class}}"),
            q(
                f"histogram_quantile(0.99, sum by (namespace, pod, le) "
                f"(rate(lifeguard_upstream_response_latency_seconds_bucket{{{SEL}}}[{RATE}])))",
                "{{pod}} vLLM headers p99",
                "C",
            ),
        )
    )
    dash = dash.with_panel(
        stat.Panel()
        .title("Lifeguard version")
        .description("lifeguard_build_info: the proxy build each pod runs.")
        .datasource(DS)
        .with_target(q(f"max by (namespace, pod, version) (lifeguard_build_info{{{SEL}}})", "{{pod}} {{version}}"))
        .text_mode(cm.BigValueTextMode.NAME)
        .height(4)
        .span(24)
    )

    built = dash.build()
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(built))


def configmap(dashboard_json: str) -> str:
    """The provisioning ConfigMap: the dashboard JSON as a literal block, byte for byte."""
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_json.splitlines())
    return (
        "# Generated by deploy/grafana/dashboard.py; do not edit by hand.\n"
        "# Grafana's dashboard sidecar (kube-prometheus-stack: grafana.sidecar.dashboards.enabled)\n"
        '# loads every ConfigMap labelled grafana_dashboard: "1".\n'
        "# yamllint disable rule:line-length\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: vllm-lifeguard-dashboard\n"
        "  labels:\n"
        '    grafana_dashboard: "1"\n'
        "    app.kubernetes.io/name: vllm-lifeguard\n"
        "  annotations:\n"
        "    grafana_folder: vLLM\n"
        "data:\n"
        "  lifeguard-dashboard.json: |\n" + body
    )


def main() -> None:
    text = json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (HERE / "lifeguard-dashboard.json").write_text(text)
    cm_text = configmap(text)
    assert yaml.safe_load(cm_text)["data"]["lifeguard-dashboard.json"] == text  # the block is exact
    (HERE / "configmap.yaml").write_text(cm_text)


if __name__ == "__main__":
    main()
