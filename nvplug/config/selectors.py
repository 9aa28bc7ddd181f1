"""Which GPUs a config names: NVIDIA's product patterns, and the selectors of nvplug.devices.

A pattern is NVIDIA's: `*` stands for any text, everything else is literal, and the
pattern may match anywhere in the name (NVIDIA searches with an unanchored regular
expression), so `A100` matches `NVIDIA A100-SXM4-80GB` and `1g.10gb` matches `1g.10gb.me`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import yaml

from nvplug.config.schema import key
from nvplug.config.value_readers import GPU_UUID, MAX_DEVICES, MIG_INDEX, each_once, integer, string
from nvplug.config.yaml_reader import INT_TAG, ReadContext, sequence
from nvplug.core.gpu import Gpu, normalize_bus_id

SelectorKind = Literal["index", "uuid", "bus id", "product"]
_BUS_ID = re.compile(r"([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


def matches(pattern: str, text: str) -> bool:
    """NVIDIA's match: `*` is any text, and the pattern may sit anywhere in `text`."""
    return _compiled(pattern).search(text) is not None


def covers(first: str, second: str) -> bool:
    """True when every name `second` matches, `first` matches too (so `second` never wins after it).

    Decided on the patterns: `first`, unanchored, must match `second` read as text in which each
    `*` of `second` can only be matched by a `*` of `first`. Sure when it says True.
    """
    parts = first.split("*")
    # Tokens of `second`: literal characters, and None for each of its wildcards.
    tokens: list[str | None] = []
    for n, part in enumerate(second.split("*")):
        if n:
            tokens.append(None)
        tokens.extend(part)
    # Unanchored: as if `first` were *first*.
    pieces = ((), *(tuple(p) for p in parts), ())
    return _glob_tokens(pieces, tuple(tokens))


def _glob_tokens(pieces: tuple[tuple[str, ...], ...], tokens: tuple[str | None, ...]) -> bool:
    """Pieces are literal runs between stars: the first must sit at the start, the last at the end,
    the others in order anywhere; a wildcard token only fits inside a star."""

    def fits(piece: tuple[str, ...], at: int) -> bool:
        return at + len(piece) <= len(tokens) and all(tokens[at + i] == c for i, c in enumerate(piece))

    head, *middle, tail = pieces
    if not fits(head, 0):
        return False
    at = len(head)
    end = len(tokens) - len(tail)
    if end < at or not fits(tail, end):
        return False
    for piece in middle:
        while at + len(piece) <= end and not fits(piece, at):
            at += 1
        if at + len(piece) > end:
            return False
        at += len(piece)
    return True


@dataclass(frozen=True)
class Selector:
    """One entry of nvplug.devices.include or exclude: a GPU index, GPU UUID, PCI bus id or product pattern."""

    kind: SelectorKind
    value: str

    @classmethod
    def parse(cls, text: str) -> Selector:
        if text.isascii() and text.isdigit():
            return cls("index", str(int(text)))
        if text.startswith("GPU-"):
            return cls("uuid", text)
        if _BUS_ID.fullmatch(text):
            return cls("bus id", normalize_bus_id(text if text.count(":") == 2 else f"0000:{text}"))
        return cls("product", text)

    def picks(self, gpu: Gpu) -> bool:
        if self.kind == "index":
            return str(gpu.index) == self.value
        if self.kind == "uuid":
            return gpu.uuid == self.value
        if self.kind == "bus id":
            return normalize_bus_id(gpu.bus_id) == self.value
        return matches(self.value, gpu.name or "")

    def __str__(self) -> str:
        return f"{self.kind} {self.value}"


def read_selectors(ctx: ReadContext, node: yaml.Node, path: str) -> tuple[Selector, ...]:
    """GPU indices, GPU UUIDs, PCI bus ids and product patterns, each once; each names whole GPUs."""
    return each_once(ctx, sequence(ctx, node, path), _selector)


def _selector(ctx: ReadContext, item: yaml.Node, item_path: str) -> Selector:
    if isinstance(item, yaml.ScalarNode) and item.tag == INT_TAG:
        index = integer(ctx, item, item_path, "a GPU index")
        if not 0 <= index < MAX_DEVICES:
            raise ctx.error(item, item_path, f"GPU index {index} is out of range 0-{MAX_DEVICES - 1}")
        text = str(index)
    else:
        text = string(ctx, item, item_path)
    if text.startswith("MIG-") or MIG_INDEX.fullmatch(text):
        raise ctx.error(item, item_path, f"{text!r} is a MIG device; nvplug.devices picks whole GPUs")
    if text.startswith("GPU-") and not GPU_UUID.fullmatch(text):
        raise ctx.error(item, item_path, f"{text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    selector = Selector.parse(text)
    if selector.kind == "index" and int(selector.value) >= MAX_DEVICES:
        raise ctx.error(item, item_path, f"GPU index {selector.value} is out of range 0-{MAX_DEVICES - 1}")
    return selector


def selector_texts(selectors: tuple[Selector, ...]) -> list[str]:
    """How `config show` writes selectors."""
    return [s.value for s in selectors]


@dataclass(frozen=True)
class DeviceFilter:
    """nvplug.devices: the GPUs nvplug hands out. An excluded GPU is still health-watched and shown."""

    include: tuple[Selector, ...] = field(
        default=(),
        metadata=key("include", "the GPUs handed out; none listed: every GPU", read_selectors, show=selector_texts),
    )
    exclude: tuple[Selector, ...] = field(
        default=(),
        metadata=key(
            "exclude", "GPUs not handed out, though still health-watched", read_selectors, show=selector_texts
        ),
    )

    def excludes(self, gpu: Gpu) -> bool:
        return self.why(gpu) is not None

    def why(self, gpu: Gpu) -> str | None:
        """Why the GPU is left out, for the operator; None if it is not."""
        if self.include and not any(s.picks(gpu) for s in self.include):
            return "not in nvplug.devices.include"
        hit = next((s for s in self.exclude if s.picks(gpu)), None)
        return f"nvplug.devices.exclude: {hit}" if hit is not None else None

    def unmatched(self, gpus: tuple[Gpu, ...]) -> list[str]:
        """Selectors of one GPU (index, UUID, bus id) that pick no GPU present: a typo, or a GPU gone."""
        return [
            f"{key} {s}"
            for key, selectors in (("include", self.include), ("exclude", self.exclude))
            for s in selectors
            if s.kind != "product" and not any(s.picks(g) for g in gpus)
        ]
