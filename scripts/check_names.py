"""The layout's naming rules, for `make lint`: no two modules share a name, and no two types do.

Generated code (nvplug/protos) is left out; a type is a top-level class or a CapWords alias.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nvplug"
SKIP = {"__init__", "__main__"}


def _is_alias(node: ast.Assign) -> bool:
    """`Event = A | B`, `Devices = Literal[...]`: a CapWords name bound at module level (constants are CAPS)."""
    target = node.targets[0]
    return isinstance(target, ast.Name) and target.id[0].isupper() and not target.id.isupper()


def main() -> int:
    modules: dict[str, list[str]] = defaultdict(list)
    types: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if rel.parts[1] == "protos":
            continue
        if path.stem not in SKIP:
            modules[path.stem].append(str(rel))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                types[node.name].append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Assign) and _is_alias(node):
                types[node.targets[0].id].append(f"{rel}:{node.lineno}")  # type: ignore[attr-defined]
    problems = [f"module name {name!r} used by {', '.join(where)}" for name, where in modules.items() if len(where) > 1]
    problems += [f"type name {name!r} defined at {', '.join(where)}" for name, where in types.items() if len(where) > 1]
    for problem in problems:
        print(f"check_names: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
