"""The one table renderer (the tools' results, the test kit's GPU topology): nccl-tests-style fixed-width text, and GitHub markdown.

Example:
    >>> print(text(["impl", "time"], {"case A": [{"impl": "stock", "time": "1.00 ms"}]}, left={"impl"}))
    #
    # impl      time
    # case: case A
      stock  1.00 ms
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

Cells = Mapping[str, str]


def text(
    columns: Sequence[str],
    sections: Mapping[str | None, Sequence[Cells]],
    *,
    left: Collection[str] = (),
    notes: Sequence[str] = (),
    commented: bool = True,
) -> str:
    """Rows of cells (keyed by column) under their section headings, columns padded to fit.

    ``sections`` maps a heading (``"case: <name>"`` lines; ``None`` for none) to its rows;
    columns in ``left`` are left-aligned, the others right-aligned. With ``commented``
    (nccl-tests style) the notes, the column line and the headings start with ``#`` and
    rows are indented by two spaces; without, everything is plain.
    """
    rows = [row for group in sections.values() for row in group]
    widths = {c: max([len(c)] + [len(row[c]) for row in rows]) for c in columns}

    def line(cells: Cells, prefix: str) -> str:
        padded = (
            cells[c].ljust(widths[c]) if c in left else cells[c].rjust(widths[c]) for c in columns
        )
        return (prefix + "  ".join(padded)).rstrip()

    mark, indent = ("# ", "  ") if commented else ("", "")
    out = [f"{mark}{note}".rstrip() for note in notes]
    if commented:
        out.append("#")
    out.append(line({c: c for c in columns}, mark))
    for heading, group in sections.items():
        if heading is not None:
            out.append(f"{mark}case: {heading}")
        out += [line(row, indent) for row in group]
    return "\n".join(out) + "\n"


def markdown(columns: Sequence[str], rows: Sequence[Cells], *, left: Collection[str] = ()) -> str:
    """A GitHub markdown table (``|`` in cells escaped)."""

    def cell(value: str) -> str:
        return value.replace("|", "\\|")

    lines = [
        "| " + " | ".join(cell(c) for c in columns) + " |",
        "|" + "|".join(":---" if c in left else "---:" for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"
