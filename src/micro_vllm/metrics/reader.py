"""vLLM's metrics reader: the ``vllm:`` metrics of a Prometheus registry as plain objects.

``LLM.get_metrics()`` returns them from the registry of its ``PrometheusStatLogger``: one ``Counter``,
``Gauge`` or ``Histogram`` per metric and label set, under vLLM's names and types, so that a script
written for vLLM's reader runs unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    """A metric's name and one of its label sets (a metric with several label sets, such as
    ``vllm:request_success`` by finish reason, gives one ``Metric`` each)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only goes up."""

    value: int


@dataclass
class Vector(Metric):
    """A list of counters by position. vLLM's one such metric counts speculative decoding's accepted
    tokens per position; none of this engine's metrics is one, but a script may test for the type."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations counted into buckets: ``buckets`` maps each bucket's upper bound, as Prometheus
    writes it ("0.5", "+Inf"), to the observations at or below it; ``count`` is all of them and
    ``sum`` their total."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:`` counter, gauge and histogram in ``registry``, with its current values."""
    collected: list[Metric] = []
    for metric in registry.collect():
        if not metric.name.startswith("vllm:"):
            continue
        if metric.type == "gauge":
            collected += [Gauge(metric.name, s.labels, s.value) for s in metric.samples]
        elif metric.type == "counter":
            collected += [Counter(metric.name, s.labels, int(s.value)) for s in metric.samples
                          if s.name == metric.name + "_total"]
        elif metric.type == "histogram":
            collected += _histograms(metric)
    return collected


def _histograms(metric) -> list[Histogram]:
    """One ``Histogram`` per label set of a Prometheus histogram, from its ``_bucket`` samples (one per
    upper bound ``le``), its ``_count`` and its ``_sum``."""
    buckets: dict[frozenset, dict[str, int]] = defaultdict(dict)
    counts: dict[frozenset, int] = {}
    sums: dict[frozenset, float] = {}
    for sample in metric.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = frozenset(labels.items())
        if sample.name == metric.name + "_bucket":
            buckets[key][sample.labels["le"]] = int(sample.value)
        elif sample.name == metric.name + "_count":
            counts[key] = int(sample.value)
        elif sample.name == metric.name + "_sum":
            sums[key] = sample.value
    return [Histogram(metric.name, dict(key), counts[key], sums[key], buckets[key]) for key in counts]
