"""cudarecv's command line: ``python -m cudarecv <subcommand> [options]``, where
``python -m cudarecv <subcommand> --help`` describes each subcommand and its options
(``--version`` prints the version).

Each subcommand lives in its own module of :mod:`cudarecv.tools`, which exposes
``register(subparsers)`` adding its parser with ``set_defaults(func=...)``;
``func(args)`` returns the process exit status. A parser's description, its
``--help`` text, is the first paragraph of its module's docstring as plain text
(:func:`plain`: no reStructuredText markup).

Errors: everything the command line reports as an error is one line on stderr,
``cudarecv <subcommand>: error: <what>`` (argparse's form; for a bad option
argparse prints its usage line first). A bad option exits 2 and its error names
the flag and the value: option values are parsed by the ``type=`` functions
here (argparse then writes ``argument --bucket-bytes: not a size: 'abc' ...``),
and a check that needs more than one option raises :class:`OptionError`, which
names its flag the same way. A failed run exits 1, an interrupted one 130.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from collections.abc import Callable

from cudarecv import ArgumentError

PROG = "cudarecv"
SUBCOMMANDS = ("compare", "demo", "report", "tune")


class OptionError(ArgumentError):
    """A bad option found after parsing; ``str()`` names the flag as argparse does."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(f"argument {flag}: {message}" if flag else message)
        self.flag = flag


def error(command: str, message: str) -> None:
    """Print ``cudarecv <command>: error: <message>`` on stderr (the one error form of the tools;
    ``cudarecv: error: <message>`` without a command)."""
    sys.stderr.write(
        (f"{PROG} {command}: error: {message}" if command else f"{PROG}: error: {message}") + "\n"
    )
    sys.stderr.flush()  # (one write: see console.progress)


# --------------------------------------------------------------------------- option types (argparse names the flag)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def size(text: str) -> int:
    """An argparse ``type``: a positive byte count, ``1MiB``, ``256KiB``, ``4096``, ``1MB``..."""
    from .transfer_ranks import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_or_zero(text: str) -> int:
    """:func:`size`, or 0."""
    return 0 if str(text).strip() == "0" else size(text)


# --------------------------------------------------------------------------- entry point

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]*)`")  # :func:`x.f` -> x.f, :func:`~x.f` -> f
_MARKUP = re.compile(r"(``|\*\*)(.+?)\1")  # ``literal``, **strong**


def plain(doc: str) -> str:
    """The first paragraph of docstring ``doc`` as plain text: its lines joined, and reStructuredText's
    roles, literals and emphasis unmarked.

    Example:
        >>> plain("Run ``tune`` (:mod:`~cudarecv.tools.tune`) **once**.\\n\\nMore.")
        'Run tune (tune) once.'
    """
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _MARKUP.sub(r"\2", text)


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m cudarecv`` with ``argv`` (default: the command line's); the exit status.

    A Ctrl-C that no subcommand caught (while torch imports, say) ends it as theirs do: one line
    (``cudarecv <subcommand>: error: interrupted``) and status 130, no traceback; a cudarecv error (e.g. a tune
    file that cannot be written) in one line too, status 1.
    """
    from cudarecv.core.errors import Error

    words = sys.argv[1:] if argv is None else argv
    command = next((word for word in words if word in SUBCOMMANDS), None)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        error(command or "", "interrupted")
        return 130
    except Error as problem:  # (a cudarecv error names its cause and fix: one line, no traceback)
        error(command or "", str(problem))
        return 1


def _main(argv: list[str] | None) -> int:
    from cudarecv import __version__

    parser = argparse.ArgumentParser(prog=PROG, description=plain(__doc__))
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<subcommand>")
    commands = {}
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"cudarecv.tools.{name}")
        commands[name] = module.register(subparsers)
        commands[name].description = plain(module.__doc__ or "")
    args, unknown = parser.parse_known_args(argv)
    if (
        unknown
    ):  # argparse would report them as the top-level parser's: say which subcommand refused them
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)
