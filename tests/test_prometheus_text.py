"""The daemon's own series are written by nvplug (status/prometheus_text.py), not by prometheus_client's
generate_latest: the text must be the same, byte for byte, for every kind of family and value."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from nvplug.core.snapshot import Snapshot
from nvplug.status.prometheus_text import registry_text
from nvplug.status.status_server import Metrics


class _Families(Collector):
    """Families made at collect time, as nvplug's collectors make them, with awkward values."""

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("odd_values", 'Help with a \\ and a\nnewline and "quotes"', labels=["what"])
        for what, value in [("inf", float("inf")), ("-inf", float("-inf")), ("nan", float("nan"))]:
            gauge.add_metric([what], value)
        gauge.add_metric(['quote " backslash \\ newline \n'], 1.0)
        gauge.add_metric(["big"], 123456789.0)
        gauge.add_metric(["small"], 1e-9)
        gauge.add_metric(["negative"], -2.5)
        stamped = CounterMetricFamily("stamped", "A counter with a timestamp", labels=["b", "a"])
        stamped.add_metric(["2", "1"], 7, timestamp=1700000000.25)
        yield from (gauge, stamped, GaugeMetricFamily("empty", "No series"))


def test_the_text_is_generate_latests_for_every_kind_of_family() -> None:
    registry = CollectorRegistry()
    counter = Counter("events", "Events, by kind", ["source", "kind"], registry=registry)
    counter.labels("udev", "add").inc()
    counter.labels("nvml", 'x"id').inc(3)
    Counter("unlabelled", "Never counted", registry=registry)
    histogram = Histogram("latency_seconds", "Latency", ["resource"], buckets=(0.001, 0.01, 1.0), registry=registry)
    histogram.labels("nvidia.com/gpu").observe(0.005)
    histogram.labels("nvidia.com/gpu").observe(2.0)
    Summary("sizes", "Sizes", registry=registry).observe(12)
    Gauge("level", "Level", registry=registry).set(0.1)
    Info("build", "Build information", registry=registry).info({"version": "1.2.3", "python": "3.11"})
    Enum("phase", "Phase", states=["up", "down"], registry=registry).state("down")
    registry.register(_Families())

    assert registry_text(registry) == generate_latest(registry).decode()


def test_the_daemons_counters_render_as_prometheus_client_would() -> None:
    metrics = Metrics(list, snapshot=lambda: Snapshot(revision=1))
    metrics.events.labels("udev", "add").inc()
    metrics.transitions.labels("Unhealthy", "xid 79").inc()
    metrics.latency.labels("nvidia.com/gpu").observe(0.0007)
    metrics.rejoin.labels("nvidia.com/gpu").observe(0.003)

    text = metrics.render().decode()

    assert text == generate_latest(metrics.registry).decode()
    assert 'nvplug_health_transitions_total{reason="xid 79",to="Unhealthy"} 1.0\n' in text
    assert 'nvplug_event_to_list_and_watch_seconds_bucket{le="0.001",resource="nvidia.com/gpu"} 1.0\n' in text
