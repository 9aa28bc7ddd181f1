"""Prometheus text (format 0.0.4), written here rather than by prometheus_client's `generate_latest`, which
checks and escapes each name and label name of each series, per scrape: that was more than half the cost of
the daemon's three dozen own series, and more than all the GPUs' reads for thousands of per-container ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# As prometheus_client writes a value (Go's notation: +Inf, NaN, 1e+06), typed.
_value: Callable[[float], str] = floatToGoString

# OpenMetrics types written as the text format's, and the samples it puts in gauges of their own after.
_TYPES = {"stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_APART = ("_created", "_gsum", "_gcount")


class Families:
    """Series written directly, for the many: labels are rendered once per device and container by the
    caller, and each family's lines are kept together however the series come."""

    def __init__(self) -> None:
        self._lines: dict[str, list[str]] = {}
        self._heads: dict[str, str] = {}

    def family(self, name: str, help_text: str, kind: str) -> list[str]:
        """The lines of a family, for series that are many: each `sample{labels} value\n`."""
        lines = self._lines.get(name)
        if lines is None:
            self._heads[name] = f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"
            lines = self._lines[name] = []
        return lines

    def add(self, name: str, help_text: str, kind: str, sample: str, labels: str, value: float) -> None:
        self.family(name, help_text, kind).append(f"{sample}{{{labels}}} {value!r}\n")

    def text(self) -> str:
        return "".join(self._heads[name] + "".join(lines) for name, lines in self._lines.items())


def label_text(labels: Mapping[str, str]) -> str:
    """`a="x",b="y"`, each value escaped as the text format wants."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def registry_text(registry: Collector) -> str:
    """What `generate_latest(registry)` writes, the same text (names nvplug gives need no escaping)."""
    out: list[str] = []
    for metric in registry.collect():
        name, kind = metric.name, metric.type
        if kind == "counter":
            name += "_total"
        elif kind == "info":
            name, kind = f"{name}_info", "gauge"
        else:
            kind = _TYPES.get(kind, kind)
        help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        apart: dict[str, list[str]] = {}
        for sample in metric.samples:
            suffix = sample.name[len(metric.name) :]
            if suffix in _APART and sample.name.startswith(metric.name):
                apart.setdefault(suffix, []).append(_sample_line(sample))
            else:
                out.append(_sample_line(sample))
        for suffix, lines in sorted(apart.items()):
            out.append(f"# HELP {metric.name}{suffix} {help_text}\n# TYPE {metric.name}{suffix} gauge\n")
            out += lines
    return "".join(out)


def _sample_line(sample: Sample) -> str:
    at = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
    value = _value(sample.value)
    if not sample.labels:
        return f"{sample.name} {value}{at}\n"
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}} {value}{at}\n"


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value
