"""The daemon's /metrics as a test reads it: samples by name, summed over the labels asked for."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from nvplug.status import status_client
from nvplug.testing.simulated_node import SimulatedNode

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(node: SimulatedNode) -> Samples:
    status, text = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    assert status == 200, text
    return parse(text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))
