"""Command line: ``python -m cudarecv <subcommand>``.

Each subcommand lives in its own module, which exposes ``register(subparsers)``
adding its parser with ``set_defaults(func=...)``; ``func(args)`` returns the
process exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = ("compare", "demo", "report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudarecv", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"cudarecv._{name}").register(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
