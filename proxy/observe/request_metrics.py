"""The series observed on every forwarded request, kept as plain numbers, turned into samples when read.

prometheus_client's `observe` and `inc` take a lock and walk buckets in Python (2.3 µs of a request's ~19 µs,
docs/performance.md); here an observation is one `bisect` and two additions, the loop the only writer. The same
names, HELP texts, buckets and labels; no `*_created` sample.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_INF = float("inf")


class FoldedHistogram:
    """One series of a histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value ("le")
        self.total += value


class _Family(Collector):
    """What a family of either kind shares: its name, HELP text and label names, and its empty metric."""

    _kind: type[HistogramMetricFamily] | type[CounterMetricFamily]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self._documentation = documentation
        self._labelnames = list(labelnames)

    def _empty(self) -> Metric:
        return self._kind(self.name, self._documentation, labels=self._labelnames)

    def describe(self) -> list[Metric]:
        return [self._empty()]


class HistogramFamily(_Family):
    """A histogram whose series are made up front, one per tuple of label values."""

    _kind = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self._bounds = (*buckets, _INF) if buckets[-1] != _INF else tuple(buckets)
        self._les: list[str] = [floatToGoString(bound) for bound in self._bounds]  # type: ignore[no-untyped-call]
        self._series: dict[tuple[str, ...], FoldedHistogram] = {}

    def labels(self, *values: str) -> FoldedHistogram:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = FoldedHistogram(self._bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self._documentation, labels=self._labelnames)
        for values, series in self._series.items():
            cumulative, running = [], 0
            for le, count in zip(self._les, series.counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric(list(values), cumulative, series.total)
        yield family


class CounterFamily(_Family):
    """A counter whose series are made up front; each is a dict entry its owner adds to (`counts(...)`)."""

    _kind = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], last: Sequence[str]) -> None:
        """`last`: the closed set of values of the last label, the one the hot path chooses by."""
        super().__init__(name, documentation, labelnames)
        self._last = tuple(last)
        self._series: dict[tuple[str, ...], dict[str, int]] = {}

    def counts(self, *values: str) -> dict[str, int]:
        """The counts by the last label's value, for the other labels' `values`: `counts[value] += 1` is an
        event (a value outside the closed set raises KeyError)."""
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = dict.fromkeys(self._last, 0)
        return series

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self._documentation, labels=self._labelnames)
        for values, series in self._series.items():
            for last, count in series.items():
                family.add_metric([*values, last], count)
        yield family
