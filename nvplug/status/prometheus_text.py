"""Prometheus text (format 0.0.4), written by nvplug: the daemon's own counters and histograms, the families
its collectors make at each scrape, and the GPU series.

Not prometheus_client: importing it cost the daemon 1.8 MiB of RSS (an HTTP server, WSGI and process
collectors come along), and its `generate_latest` checks and escapes each name and label name of each
series on every scrape: 3.6 times what writing the daemon's own series here costs, and more than all the
GPUs' reads where thousands of per-container series are written. The counters are counted and read on the
event loop only, so they need no lock. The text is what prometheus_client writes, less its `_created`
series.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

Labels = tuple[str, ...]


def value_text(value: float) -> str:
    """A sample's value as Go's clients write it (and prometheus_client): +Inf, -Inf, NaN, else the shortest
    float, in an exponent from a million on (1.0, 0.0005, 1.23456789e+08)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        digits = (text[:dot] + text[dot + 1 :]).rstrip("0")
        return f"{digits[0]}{'.' if len(digits) > 1 else ''}{digits[1:]}e+{dot - 1:02d}"
    return text


def label_text(labels: Mapping[str, str]) -> str:
    """`a="x",b="y"`, each value escaped as the text format wants."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _sample(name: str, names: Sequence[str], values: Iterable[str], value: float) -> str:
    """One series' line, its labels in name order (as prometheus_client writes them)."""
    labels = label_text(dict(sorted(zip(names, values, strict=True))))
    return f"{name}{{{labels}}} {value_text(value)}\n" if labels else f"{name} {value_text(value)}\n"


def _head(name: str, help_text: str, kind: str) -> str:
    escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


class Family:
    """A family made at scrape time from the state, as a collector reads it: counters get `_total`."""

    def __init__(self, name: str, help_text: str, kind: str, labels: Sequence[str] = ()) -> None:
        self.name = f"{name}_total" if kind == "counter" else name
        self._head = _head(self.name, help_text, kind)
        self._labels = tuple(labels)
        self._lines: list[str] = []

    def add_metric(self, values: Sequence[str], value: float) -> None:
        self._lines.append(_sample(self.name, self._labels, values, value))

    def text(self) -> str:
        return self._head + "".join(self._lines)


class Collector(Protocol):
    """What reads the state at each scrape into families."""

    def collect(self) -> Iterable[Family]: ...


class Counter:
    """A counter by label values, counted as things happen."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str]) -> None:
        self.name = f"{name}_total"
        self._head = _head(self.name, help_text, "counter")
        self._labels = tuple(labels)
        self._counts: dict[Labels, float] = {}

    def labels(self, *values: str) -> _Count:
        assert len(values) == len(self._labels), (self.name, values)
        return _Count(self._counts, values)

    def text(self) -> str:
        return self._head + "".join(_sample(self.name, self._labels, k, v) for k, v in self._counts.items())


class _Count:
    __slots__ = ("_counts", "_key")

    def __init__(self, counts: dict[Labels, float], key: Labels) -> None:
        self._counts, self._key = counts, key

    def inc(self, amount: float = 1.0) -> None:
        self._counts[self._key] = self._counts.get(self._key, 0.0) + amount


class Histogram:
    """A histogram by label values: cumulative buckets (`le`, +Inf last), `_sum` and `_count`."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name = name
        self._head = _head(name, help_text, "histogram")
        self._labels = tuple(labels)
        self._bounds = (*sorted(buckets), math.inf)
        self._observed: dict[Labels, _Observed] = {}

    def labels(self, *values: str) -> _Observed:
        assert len(values) == len(self._labels), (self.name, values)
        found = self._observed.get(values)
        if found is None:
            found = self._observed[values] = _Observed(self._bounds)
        return found

    def text(self) -> str:
        lines = [self._head]
        names = (*self._labels, "le")
        for key, seen in self._observed.items():
            running = 0
            for bound, n in zip(self._bounds, seen.counts, strict=True):
                running += n
                lines.append(_sample(f"{self.name}_bucket", names, (*key, value_text(bound)), running))
            lines.append(_sample(f"{self.name}_count", self._labels, key, running))
            lines.append(_sample(f"{self.name}_sum", self._labels, key, seen.total))
        return "".join(lines)


class _Observed:
    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not yet cumulative
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for at, bound in enumerate(self._bounds):
            if value <= bound:
                self.counts[at] += 1
                return


def info_text(name: str, help_text: str, labels: Mapping[str, str]) -> str:
    """A constant `<name>_info` gauge of 1 whose labels say what is so (a build's versions)."""
    return _head(f"{name}_info", help_text, "gauge") + _sample(f"{name}_info", list(labels), labels.values(), 1.0)


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
            self._heads[name] = _head(name, help_text, kind)
            lines = self._lines[name] = []
        return lines

    def add(self, name: str, help_text: str, kind: str, sample: str, labels: str, value: float) -> None:
        self.family(name, help_text, kind).append(f"{sample}{{{labels}}} {value!r}\n")

    def text(self) -> str:
        return "".join(self._heads[name] + "".join(lines) for name, lines in self._lines.items())
