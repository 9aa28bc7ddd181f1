"""Config keys declared once, on the model's dataclass fields: reading, `config show` and errors follow them.

A field's `metadata` holds its Key: the file's key name, how its value is read (a value reader, a
nested section or a list of entries) and a line of documentation; the field gives the type and the
default. The known keys of every error message are the declared names, in declaration order.
A class may also list `dropped_keys`: keys that are checked, then dropped, with no field.
What crosses keys (a default taken from another key, entries that must not overlap) is a
finisher per class, which the loader hands in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import yaml

from nvplug.config.value_readers import Reader
from nvplug.config.yaml_reader import ConfigError, NodeMap, ReadContext, is_null, join, sequence

T = TypeVar("T")

_META = "nvplug.config"


@dataclass(frozen=True)
class Key:
    """One key of the file; exactly one of `read`, `section` and `entries` says how its value is read."""

    # camelCase as in the file; dotted where Config keeps a nested key as a flat field.
    name: str
    doc: str
    read: Reader | None = None
    section: type | None = None
    entries: type | None = None
    required: bool = False
    # Counted in its turn, read after its section's other keys, as it always was.
    late: bool = False
    # Handed to its reader as it is, null included, and not counted first.
    direct: bool = False
    # After the other keys in the file's order (and in `config show`), whatever the field's position.
    last: bool = False
    # After the other keys in `config show` only.
    shown_last: bool = False
    # How `config show` writes the value, where the plain form does not do.
    show: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if sum(how is not None for how in (self.read, self.section, self.entries)) != 1:
            raise TypeError(f"{self.name}: give exactly one of read, section and entries")


def key(
    name: str,
    doc: str,
    read: Reader | None = None,
    *,
    section: type | None = None,
    entries: type | None = None,
    required: bool = False,
    late: bool = False,
    direct: bool = False,
    last: bool = False,
    shown_last: bool = False,
    show: Callable[[Any], Any] | None = None,
) -> dict[str, Key]:
    """A field's metadata that declares its key."""
    return {_META: Key(name, doc, read, section, entries, required, late, direct, last, shown_last, show)}


class Found:
    """A mapping of the file being read: its node, path and key nodes, and what a finisher may need around it."""

    def __init__(
        self,
        ctx: ReadContext,
        node: yaml.Node,
        path: str,
        nodes: dict[str, yaml.Node],
        earlier: tuple[Any, ...],
        enclosing: Mapping[str, Any],
    ) -> None:
        self.ctx = ctx
        self.node = node
        self.path = path
        self.nodes = nodes
        # For an entry of a list: the entries before it; for its enclosing section: the values read so far.
        self.earlier = earlier
        self.enclosing = enclosing

    @property
    def where(self) -> str:
        return self.ctx.where(self.node, self.path)

    def error(self, message: str) -> ConfigError:
        return self.ctx.error(self.node, self.path, message)


# Builds a section from its values (by field name), with the checks that cross its keys.
Finish = Callable[[Found, dict[str, Any]], Any]


_DECLARED: dict[type, tuple[tuple[str | None, Key], ...]] = {}
_TREES: dict[type, dict[str, Any]] = {}


def declared(cls: type) -> tuple[tuple[str | None, Key], ...]:
    """(field name, key) in the file's order; keys only checked (`dropped_keys`) have no field."""
    if cls not in _DECLARED:
        keys: list[tuple[str | None, Key]] = [(f.name, f.metadata[_META]) for f in fields(cls) if _META in f.metadata]
        keys += [(None, k) for k in getattr(cls, "dropped_keys", ())]
        _DECLARED[cls] = tuple(sorted(keys, key=lambda pair: pair[1].last))
    return _DECLARED[cls]


def _tree(cls: type) -> dict[str, Any]:
    """The declared keys as nested levels: a dotted name is a key inside groups."""
    if cls not in _TREES:
        tree: dict[str, Any] = {}
        for name, k in declared(cls):
            *groups, last = k.name.split(".")
            level = tree
            for group in groups:
                level = level.setdefault(group, {})
            level[last] = (name, k)
        _TREES[cls] = tree
    return _TREES[cls]


def known_keys(cls: type, group: str = "") -> tuple[str, ...]:
    """The keys of `cls`'s mapping, or of one of its groups ("nvplug")."""
    level = _tree(cls)
    for part in group.split(".") if group else ():
        level = level[part]
    return tuple(level)


def read_section(
    cls: type[T],
    ctx: ReadContext,
    node: yaml.Node,
    path: str,
    finish: Mapping[type, Finish],
    earlier: tuple[Any, ...] = (),
    enclosing: Mapping[str, Any] | None = None,
) -> T:
    """One mapping of the file as `cls`: its declared keys read, then its finisher's checks. Null is empty."""
    tree = _tree(cls)
    nodes = NodeMap(ctx, node, path).items(tuple(tree))
    values: dict[str, Any] = {}
    _read_level(tree, ctx, node, path, nodes, values, finish, grouped=False)
    done = finish.get(cls)
    found = Found(ctx, node, path, nodes, earlier, enclosing or {})
    section: T = done(found, values) if done is not None else cls(**values)
    return section


def read_grouped(
    cls: type, ctx: ReadContext, node: yaml.Node, nodes: dict[str, yaml.Node], finish: Mapping[type, Finish]
) -> dict[str, Any]:
    """The values (by field name) of a class whose keys sit in groups, from its mapping's key nodes.

    Its groups and sections are opened straight from their nodes, as the loader always has, null as empty."""
    values: dict[str, Any] = {}
    _read_level(_tree(cls), ctx, node, "", nodes, values, finish, grouped=True)
    return values


def _read_level(
    tree: dict[str, Any],
    ctx: ReadContext,
    node: yaml.Node,
    path: str,
    nodes: dict[str, yaml.Node],
    values: dict[str, Any],
    finish: Mapping[type, Finish],
    grouped: bool,
) -> None:
    late: list[tuple[str | None, Key, yaml.Node, str]] = []
    for segment, child in tree.items():
        child_path = join(path, segment)
        value_node = nodes.get(segment)
        if isinstance(child, dict):
            if value_node is not None:
                sub = NodeMap(ctx, value_node, child_path).items(tuple(child))
                _read_level(child, ctx, value_node, child_path, sub, values, finish, grouped)
            continue
        name, k = child
        direct = k.direct or (grouped and k.section is not None)
        if value_node is None or (is_null(value_node) and not direct):
            if k.required:
                raise ctx.error(value_node or node, child_path, "required, and not given")
            continue
        if not direct:
            ctx.visit(value_node, child_path)
        if k.late:
            late.append((name, k, value_node, child_path))
            continue
        value = _value(k, ctx, value_node, child_path, finish, values)
        if name is not None:
            values[name] = value
    for name, k, value_node, child_path in late:
        value = _value(k, ctx, value_node, child_path, finish, values)
        if name is not None:
            values[name] = value


def _value(
    k: Key, ctx: ReadContext, node: yaml.Node, path: str, finish: Mapping[type, Finish], enclosing: dict[str, Any]
) -> Any:
    if k.read is not None:
        return k.read(ctx, node, path)
    if k.section is not None:
        return read_section(k.section, ctx, node, path, finish)
    assert k.entries is not None
    built: list[Any] = []
    for item, item_path in sequence(ctx, node, path):
        built.append(read_section(k.entries, ctx, item, item_path, finish, tuple(built), enclosing))
    return tuple(built)


def shown(obj: Any) -> dict[str, Any]:
    """A declared dataclass as `config show` writes it: file keys, groups nested, unset (None) values left out."""
    out: dict[str, Any] = {}
    for name, k in sorted(declared(type(obj)), key=lambda pair: pair[1].shown_last):
        value = None if name is None else getattr(obj, name)
        if value is None:
            continue
        *groups, last = k.name.split(".")
        level = out
        for group in groups:
            level = level.setdefault(group, {})
        level[last] = k.show(value) if k.show is not None else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type) and declared(type(value)):
        return shown(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, frozenset):
        return sorted(value)
    return value
