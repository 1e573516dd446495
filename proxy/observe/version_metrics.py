"""The weight-version series: the generation the proxy vouches for, relabels without a change, partial weights, and
how stale the relayed tokens were (proxy/lifecycle/weight_version.py). Registered by `Metrics` on its registry;
every series has the `engine` label. docs/guides/weight-versions.md reads them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: `version_lag` of `lifeguard_tokens_total`: versions behind the newest one, the last bucket "this many or more".
VERSION_LAGS: tuple[str, ...] = ("0", "1", "2", "3+")
_LAG_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 10.0)


class VersionFamilies:
    def __init__(self, registry: CollectorRegistry) -> None:
        e = ["engine"]
        self.generation = Gauge(
            "lifeguard_weight_version_generation",
            "The generation of the weight version the proxy vouches for: it advances exactly when the engine's "
            "weights change (a session that wrote the model, a one-call update, a reload, an adapter replaced in "
            "place, a restart).",
            e,
            registry=registry,
        )
        self.relabels_unchanged = Counter(
            "lifeguard_weight_relabels_unchanged",
            "/update_weight_version calls that relabelled weights the proxy saw no change of since their last label.",
            e,
            registry=registry,
        )
        self.partial = Counter(
            "lifeguard_weight_updates_partial",
            "/update_weights calls that failed mid-way and left the weights partial (inference held until a whole "
            "update or a reload).",
            e,
            registry=registry,
        )
        self.tokens = Counter(
            "lifeguard_tokens",
            "Generated tokens relayed, counted at each request's end, by how many weight versions the newest was "
            "ahead of the one the request was dispatched on (0, 1, 2, 3+): the answer's usage.completion_tokens, "
            "else one per streamed chunk.",
            [*e, "version_lag"],
            registry=registry,
        )
        self.request_lag = Histogram(
            "lifeguard_request_version_lag",
            "An inference request's lag at its end: weight versions between the one it was dispatched on and the "
            "newest.",
            e,
            buckets=_LAG_BUCKETS,
            registry=registry,
        )

    def bind(self, engine: str) -> EngineVersionMetrics:
        return EngineVersionMetrics(self, engine)


class EngineVersionMetrics:
    def __init__(self, family: VersionFamilies, engine: str) -> None:
        self._generation = family.generation.labels(engine)
        self._relabels_unchanged = family.relabels_unchanged.labels(engine)
        self._partial = family.partial.labels(engine)
        self._tokens = {lag: family.tokens.labels(engine, lag) for lag in VERSION_LAGS}
        self._request_lag = family.request_lag.labels(engine)

    def generation(self, generation: int) -> None:
        """The vouched weight version is now `generation`."""
        self._generation.set(generation)

    def relabel_unchanged(self) -> None:
        """A relabel of weights that did not change since their last label."""
        self._relabels_unchanged.inc()

    def went_partial(self) -> None:
        """A failed /update_weights left the weights partial."""
        self._partial.inc()

    def request_ended(self, lag: int, tokens: int) -> None:
        """An inference request that produced `tokens` ended `lag` versions behind the newest."""
        self._tokens[VERSION_LAGS[min(lag, len(VERSION_LAGS) - 1)]].inc(tokens)
        self._request_lag.observe(lag)
