"""`LLM.get_metrics()`'s snapshot: the engine's Prometheus metrics as Python objects, with
the types of vLLM's `vllm.v1.metrics.reader` (`Counter`, `Gauge`, `Histogram`, `Vector`), so
that code reading vLLM's offline metrics reads these unchanged.

Every metric family named "vllm:..." or "pagedjax:..." in the registry gives one object per
label set: a counter its integer value (the family's name, without Prometheus' "_total"), a
gauge its value, a histogram its count, sum and cumulative bucket counts keyed by the upper
bound as Prometheus writes it ("0.005", ..., "+Inf"), and the per-position counter
`vllm:spec_decode_num_accepted_tokens_per_pos` one `Vector` of its counts by position.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

PREFIXES = ("vllm:", "pagedjax:")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclasses.dataclass
class Metric:
    """A metric's name and the labels of this series."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing count."""

    value: int


@dataclasses.dataclass
class Vector(Metric):
    """Counts by position (index i: the counter's `position="i"` series)."""

    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """Observations: their count and sum, and the cumulative count at each bucket's upper
    bound (the last key "+Inf", whose count is `count`)."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """The registry's "vllm:" and "pagedjax:" metrics, one object per series.

    Raises:
        ValueError: a metric of a type other than counter, gauge or histogram.
    """
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name == PER_POSITION:
                out += _vectors(family.name, samples)
            else:
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "histogram":
            out += _histograms(family)
        else:
            raise ValueError(f"metric {family.name} has type {family.type!r}")
    return out


def _vectors(name: str, samples) -> list[Vector]:
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "position"}
        by_labels.setdefault(frozenset(labels.items()), {})[int(s.labels["position"])] = int(
            s.value
        )
    return [
        Vector(name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)])
        for key, counts in by_labels.items()
    ]


def _histograms(family) -> list[Histogram]:
    series: dict[frozenset, dict] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        entry = series.setdefault(
            frozenset(labels.items()), {"buckets": {}, "count": 0, "sum": 0.0}
        )
        if s.name == family.name + "_bucket":
            entry["buckets"][s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            entry["count"] = int(s.value)
        elif s.name == family.name + "_sum":
            entry["sum"] = float(s.value)
    return [
        Histogram(family.name, dict(key), e["count"], e["sum"], e["buckets"])
        for key, e in series.items()
    ]
