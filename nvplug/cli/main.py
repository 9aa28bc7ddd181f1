"""The `nvplug` command line: the parser from the registry, then the chosen command's run."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nvplug.cli.command_registry import Run, build_parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Run = args.run  # every leaf command sets it (command_registry._add)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
