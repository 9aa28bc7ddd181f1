"""nvplug writes its own Prometheus text (status/prometheus_text.py) rather than import prometheus_client:
the text must be what prometheus_client writes for the same counts, byte for byte, less its `_created`
series, for every kind of family and value the daemon has."""

from __future__ import annotations

from collections.abc import Iterator

import prometheus_client as reference
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from nvplug.core.snapshot import Snapshot
from nvplug.status.prometheus_text import Counter, Family, Histogram, info_text
from nvplug.status.status_server import Metrics

ODD = [("inf", float("inf")), ("-inf", float("-inf")), ("nan", float("nan")), ("big", 123456789.0)]
ODD += [("million", 1e6), ("many", 2.5e20), ("small", 1e-9), ("negative", -2.5), ("zero", 0.0)]
ODD += [('quote " backslash \\ newline \n', 1.0)]
HELP = 'Help with a \\ and a\nnewline and "quotes"'
BUCKETS = (0.0005, 0.001, 0.01, 1.0, 30.0)


def _without_created(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if "_created" not in line)


def test_each_kind_of_family_is_written_as_prometheus_client_writes_it() -> None:
    registry = reference.CollectorRegistry()
    theirs = reference.Counter("events", "Events, by kind", ["source", "kind"], registry=registry)
    histogram = reference.Histogram("latency_seconds", "Latency", ["resource"], buckets=BUCKETS, registry=registry)
    reference.Info("build", "Build information", registry=registry).info({"version": "1.2.3", "python": "3.11"})

    class Made(Collector):
        def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
            gauge = GaugeMetricFamily("odd_values", HELP, labels=["what"])
            for what, value in ODD:
                gauge.add_metric([what], value)
            counter = CounterMetricFamily("records_lost", "Lost", labels=["b", "a"])
            counter.add_metric(["2", "1"], 7)
            yield from (gauge, counter, GaugeMetricFamily("empty", "No series"))

    registry.register(Made())
    ours = Counter("events", "Events, by kind", ["source", "kind"])
    latency = Histogram("latency_seconds", "Latency", ["resource"], buckets=BUCKETS)
    for counter in (theirs, ours):
        counter.labels("udev", "add").inc()
        counter.labels("nvml", 'x"id').inc(3)
        counter.labels("udev", "add").inc()
    for observed in (histogram, latency):
        for value in (0.0001, 0.0005, 0.005, 2.0, 31.0):
            observed.labels("nvidia.com/gpu").observe(value)
        observed.labels("other").observe(0.001)
    gauge = Family("odd_values", HELP, "gauge", ["what"])
    counted = Family("records_lost", "Lost", "counter", ["b", "a"])
    for what, value in ODD:
        gauge.add_metric([what], value)
    counted.add_metric(["2", "1"], 7)

    text = "".join(
        [
            ours.text(),
            latency.text(),
            info_text("build", "Build information", {"version": "1.2.3", "python": "3.11"}),
            gauge.text(),
            counted.text(),
            Family("empty", "No series", "gauge").text(),
        ]
    )

    assert text == _without_created(generate_latest(registry).decode())


def test_the_daemons_series_parse_back_to_what_was_counted() -> None:
    metrics = Metrics(list, snapshot=lambda: Snapshot(revision=1))
    metrics.events.labels("udev", "add").inc()
    metrics.events.labels("udev", "add").inc()
    metrics.transitions.labels("Unhealthy", "xid 79").inc()
    metrics.latency.labels("nvidia.com/gpu").observe(0.0007)
    metrics.rejoin.labels("nvidia.com/gpu").observe(0.003)

    text = metrics.render().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    assert samples[("nvplug_events_total", (("kind", "add"), ("source", "udev")))] == 2
    assert samples[("nvplug_health_transitions_total", (("reason", "xid 79"), ("to", "Unhealthy")))] == 1
    latency = "nvplug_event_to_list_and_watch_seconds"
    assert samples[(f"{latency}_bucket", (("le", "0.0005"), ("resource", "nvidia.com/gpu")))] == 0
    assert samples[(f"{latency}_bucket", (("le", "0.001"), ("resource", "nvidia.com/gpu")))] == 1
    assert samples[(f"{latency}_bucket", (("le", "+Inf"), ("resource", "nvidia.com/gpu")))] == 1
    assert samples[(f"{latency}_sum", (("resource", "nvidia.com/gpu"),))] == 0.0007
    assert samples[("nvplug_kernel_log_readable", ())] == 1
    build = next(labels for name, labels in samples if name == "nvplug_build_info")
    assert [name for name, _ in build] == ["grpcio", "python", "version"]
