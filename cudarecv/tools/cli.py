"""Command line: ``python -m cudarecv <subcommand>`` (``--version`` prints the version).

Each subcommand lives in its own module of :mod:`cudarecv.tools`, which exposes
``register(subparsers)`` adding its parser with ``set_defaults(func=...)``;
``func(args)`` returns the process exit status. Errors print as ``cudarecv <subcommand>: error: ...``
(argparse's form) and exit 2 for bad options, 1 for a failed run.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = ("compare", "demo", "report")


def main(argv: list[str] | None = None) -> int:
    from cudarecv import __version__

    parser = argparse.ArgumentParser(prog="cudarecv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cudarecv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"cudarecv.tools.{name}").register(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
