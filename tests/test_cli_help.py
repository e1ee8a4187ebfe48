"""``--help`` of the command line and of each subcommand: whole sentences in plain text, no reStructuredText."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cudarecv.tools.cli import SUBCOMMANDS, main, plain
from procs import HANG

# what reStructuredText in a help text looks like: ``literal``, :role:`target`, **strong**, a literal block's "::"
RST = re.compile(r"``|:[a-z]+:`|\*\*|::(\s|$)")


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _description(text: str) -> str:
    """The paragraph after the usage lines."""
    return " ".join(text.split("\n\n")[1].split())


@pytest.mark.parametrize(
    "argv", [[]] + [[name] for name in SUBCOMMANDS], ids=["top"] + list(SUBCOMMANDS)
)
def test_every_help_text_is_whole_and_plain(argv, capsys):
    text = _help(argv, capsys)
    assert not RST.search(text), RST.search(text)
    description = _description(text)
    assert description.endswith("."), description  # a whole sentence, not a docstring's first line
    assert description.startswith(
        "python -m cudarecv " + argv[0] if argv else "cudarecv's command line"
    )


def test_the_installed_entry_point_prints_the_same_help(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "cudarecv", "--help"], capture_output=True, text=True, timeout=HANG
    )
    assert out.returncode == 0 and not RST.search(out.stdout), out.stdout
    assert _description(out.stdout) == _description(_help([], capsys))


def test_plain_unmarks_roles_literals_and_emphasis():
    doc = """Run ``tune`` (:mod:`~cudarecv.tools.tune`, :func:`cudarecv.install`) **once**,
    across lines.

    Usage::
    """
    assert plain(doc) == "Run tune (tune, cudarecv.install) once, across lines."


def test_a_ctrl_c_no_subcommand_caught_ends_in_one_line(monkeypatch, capsys):
    """A Ctrl-C outside a subcommand's own handling (here: tune's whole run) ends ``main`` as theirs do:
    ``cudarecv <subcommand>: error: interrupted`` and status 130, no traceback."""
    from cudarecv.tools import tune

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        tune, "run", interrupted
    )  # (register() reads it when main() builds the parser)
    assert main(["tune", "--show"]) == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "cudarecv tune: error: interrupted\n")
