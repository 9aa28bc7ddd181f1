"""Safe reading of the config's YAML: a node tree with its lines, within limits of size, depth and node count.

The file is composed into a YAML node tree (never constructed into Python objects), so line numbers
survive, and the walk over it counts every node it visits: aliases that reuse a subtree many times
over cannot make a small file expensive.
"""

from __future__ import annotations

import yaml

MAX_BYTES = 1 << 20
# Aliases make a node tree a graph: nested ones ("billion laughs") turn a few lines into
# billions of nodes to walk. Real configs have a few hundred nodes.
MAX_NODES = 100_000
# PyYAML's composer recurses once per level; refuse well before Python's recursion limit.
MAX_DEPTH = 64

INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
STR_TAG = "tag:yaml.org,2002:str"
BOOL_TAG = "tag:yaml.org,2002:bool"
NULL_TAG = "tag:yaml.org,2002:null"
MERGE_TAG = "tag:yaml.org,2002:merge"


class ConfigError(ValueError):
    pass


# From this size on, libyaml scans the file (below, PyYAML's own scanner does, as it always did).
FAST_FROM_BYTES = 64 << 10


class _DepthLimit(yaml.composer.Composer):
    """PyYAML's composer with a nesting limit, so deep nesting is an error, not a RecursionError."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH and parent is not None:
                problem = f"nested deeper than {MAX_DEPTH} levels"
                raise yaml.composer.ComposerError(None, None, problem, parent.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Loader(_DepthLimit, yaml.SafeLoader):
    """All of PyYAML in Python: its error messages are the ones the config reports."""


if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _FastLoader(_DepthLimit, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """libyaml's scanner and parser under PyYAML's composer: the same nodes, an order of magnitude
        sooner on a large file (the pure-Python scanner takes seconds on 100,000 aliases)."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    _LOADERS: tuple[type, ...] = (_FastLoader, _Loader)
else:
    _LOADERS = (_Loader,)


def compose(text: str, source: str) -> yaml.Node | None:
    """The document's node tree; None for an empty one."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_BYTES} bytes; refusing to parse")
    *fast, exact = _LOADERS
    # A config is a few KiB: read it as PyYAML always did. A file this large is a list of
    # thousands of entries, or hostile; libyaml reads it where PyYAML's scanner would take seconds.
    for loader in fast if len(text) >= FAST_FROM_BYTES else ():
        try:
            return yaml.compose(text, Loader=loader)
        except yaml.YAMLError:
            break  # said in PyYAML's words below
    try:
        return yaml.compose(text, Loader=exact)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from err


class ReadContext:
    """One parse: the file name for messages, and the count of nodes visited so far."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.visited = 0

    def error(self, node: yaml.Node, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}, line {node.start_mark.line + 1}: {path}: {message}")

    def where(self, node: yaml.Node, path: str) -> str:
        """How messages name an entry of a list."""
        return f"{self.source}, line {node.start_mark.line + 1}: {path}"

    def visit(self, node: yaml.Node, path: str) -> None:
        self.visited += 1
        if self.visited > MAX_NODES:
            raise self.error(
                node, path or "top level", f"more than {MAX_NODES} YAML nodes (aliases expanded); refusing to read on"
            )


def scalar(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "<not a scalar>"


def is_null(node: yaml.Node | None) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL_TAG


def describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def sequence(ctx: ReadContext, node: yaml.Node, path: str) -> list[tuple[yaml.Node, str]]:
    """The items of a list with their paths (`path[i]`), each counted as visited."""
    ctx.visit(node, path)
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.error(node, path, f"must be a list, not {describe(node)}")
    out = []
    for i, item in enumerate(node.value):
        item_path = f"{path}[{i}]"
        ctx.visit(item, item_path)
        out.append((item, item_path))
    return out


class NodeMap:
    """A YAML mapping node that knows its file and key path, for error messages. Null is empty."""

    def __init__(self, ctx: ReadContext, node: yaml.Node, path: str) -> None:
        ctx.visit(node, path)
        if not isinstance(node, yaml.MappingNode) and not is_null(node):
            where = path or "the top level"
            raise ConfigError(f"{ctx.source}, line {node.start_mark.line + 1}: {where} must be a mapping")
        self.ctx = ctx
        self.node = node
        self.path = path

    def items(self, known: tuple[str, ...]) -> dict[str, yaml.Node]:
        """The value node of each key, in file order; unknown and repeated keys are errors."""
        out: dict[str, yaml.Node] = {}
        pairs = self.node.value if isinstance(self.node, yaml.MappingNode) else []
        for key_node, value in pairs:
            key = scalar(key_node)
            path = join(self.path, key)
            if key_node.tag == MERGE_TAG:
                raise self.ctx.error(key_node, path, "YAML merge keys (<<) are not supported; write the keys out")
            if key not in known:
                raise self.ctx.error(key_node, path, f"unknown key; known keys here: {', '.join(known)}")
            if key in out:
                raise self.ctx.error(key_node, path, "given twice")
            out[key] = value
        return out
