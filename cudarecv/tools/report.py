"""``python -m cudarecv report``: turn a pytest-benchmark JSON into an nccl-tests style table.

Usage::

    pytest bench/ --benchmark-json BENCH.json
    python -m cudarecv report BENCH.json [--markdown] [--png OUT.png | --no-png]

A row's time is its benchmark's ``stats.median``: the benches in ``bench/`` feed
pytest-benchmark the receiver's own per-iteration times through a virtual clock,
so the median pytest-benchmark prints is the one reported here. Each of our
benchmarks carries ``extra_info`` with ``case``, ``impl`` ("cudarecv", "stock" or
"raw"), ``mode``, ``bytes`` and ``leaves``, and optionally ``stock_mode``,
``backend`` and ``ok`` (the values of a checked transfer were right: the
``check`` column). Rows are grouped by case (input order); ``vs stock`` / ``vs
raw`` are the reference time divided by this row's time, so > 1 means this row
is faster. The text table ends with a summary: the rows, how many were checked
and wrong, and per case the best cudarecv ratio vs stock among its right rows.

Older JSON files (before the virtual clock, e.g. ``docs/bench-cpu-gloo.json``)
timed something else in ``stats`` and carry the receiver's median in
``extra_info.seconds``: where a row has it, it is reported instead, and a note
says how many rows did.

The plot has one panel per family of cases that differ only in a size in their
name (``consolidated 1MiB`` .. ``256MiB``: GB/s vs payload size, one line per
impl and mode) and one panel per other case (one bar per impl and mode); colour
is the impl, marker and line style the mode, and each panel has its legend.

This module imports no other cudarecv module but the error family and the tools' table and CLI helpers, and
matplotlib only when plotting.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cudarecv import ArgumentError

from ..testing import table
from .cli import error

NOTE = (
    "time = median of the bench's rounds (stats.median; bench/'s rounds are the receiver's own timed "
    "transfers); GB/s = bytes / time / 1e9"
)
RATIO_NOTE = (
    "vs stock = the time of stock's fastest mode in the case (its best: named in the summary) / this "
    "time; vs raw = the first raw row's time / this time (> 1: this row is faster)"
)
CHECK_NOTE = "check = the checked transfer's values: ok, WRONG, or - (not checked)"
LINK_NOTE = (
    "link = the busiest host link's bytes (its NIC counters) / the rounds' time / the link rate"
)
LEGACY_NOTE = (
    "{n} row(s) from an older bench JSON: time = their extra_info.seconds (the receiver's median; "
    "their stats timed something else)"
)
MATPLOTLIB_HINT = 'pip install "cudarecv[tools]"'  # matplotlib, the tools extra


class ReportError(ArgumentError):
    """Bad input: reported as one line on stderr, exit status 2."""


@dataclass
class Row:
    """One benchmark, with the time to report (``stats.median``, or a legacy ``extra_info.seconds``)."""

    name: str
    seconds: float
    case: str | None = None
    impl: str | None = None
    mode: str | None = None
    nbytes: int = 0
    leaves: int | None = None
    stock_mode: str | None = None
    backend: str | None = None
    ok: bool | None = (
        None  # extra_info ok: the checked transfer's values were right (None: not checked)
    )
    legacy: bool = False  # seconds came from an older JSON's extra_info.seconds
    link_util: float | None = (
        None  # extra_info link_utilisation (fan-out across hosts): busiest link's share
    )
    transport: str | None = (
        None  # extra_info transport: what carried cudarecv's payload (wire, shared memory, ...)
    )
    vs_stock: float | None = None
    vs_raw: float | None = None
    #: the mode of the stock row ``vs_stock`` divides by: stock's fastest in the case
    stock_best: str | None = None

    @property
    def categorized(self) -> bool:
        """True when the row carries our ``case``/``impl`` extra_info."""
        return self.case is not None and self.impl is not None

    @property
    def gbps(self) -> float | None:
        """Algorithm bandwidth in GB/s (1e9 bytes/s), or None for non-transfer rows."""
        if self.nbytes <= 0 or self.seconds <= 0:
            return None
        return self.nbytes / self.seconds / 1e9


# --------------------------------------------------------------------------- loading


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a pytest-benchmark JSON file; raise ReportError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not valid JSON (not UTF-8 text)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ReportError(
            f"{path} has no 'benchmarks' list; expected the output of pytest --benchmark-json"
        )
    return data


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _number(value: Any, what: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReportError(f"benchmark {name!r}: {what} is not a finite number: {value!r}")
    return float(value)


def parse_rows(data: dict[str, Any]) -> list[Row]:
    """Convert the ``benchmarks`` entries into Rows (input order kept)."""
    rows = []
    for i, bench in enumerate(data["benchmarks"]):
        if not isinstance(bench, dict):
            raise ReportError(f"benchmarks[{i}] is not an object")
        name = str(bench.get("name") or bench.get("fullname") or f"benchmarks[{i}]")
        extra = bench.get("extra_info") or {}
        if not isinstance(extra, dict):
            extra = {}
        legacy = (
            extra.get("seconds") is not None
        )  # written before the benches timed through a virtual clock
        if legacy:
            seconds = _number(extra["seconds"], "extra_info.seconds", name)
        else:
            stats = bench.get("stats")
            median = stats.get("median") if isinstance(stats, dict) else None
            seconds = _number(median, "stats.median", name)
        leaves = extra.get("leaves")
        ok = extra.get("ok")
        util = extra.get("link_utilisation")
        if ok is not None and not isinstance(ok, bool):
            raise ReportError(f"benchmark {name!r}: extra_info.ok is not true or false: {ok!r}")
        rows.append(
            Row(
                name=name,
                seconds=seconds,
                case=_opt_str(extra.get("case")),
                impl=_opt_str(extra.get("impl")),
                mode=_opt_str(extra.get("mode")),
                nbytes=int(_number(extra.get("bytes") or 0, "extra_info.bytes", name)),
                leaves=None if leaves is None else int(_number(leaves, "extra_info.leaves", name)),
                stock_mode=_opt_str(extra.get("stock_mode")),
                backend=_opt_str(extra.get("backend")),
                ok=ok,
                legacy=legacy,
                link_util=None
                if util is None
                else _number(util, "extra_info.link_utilisation", name),
                transport=_opt_str(extra.get("transport")),
            )
        )
    return rows


def load_rows(path: str | Path) -> tuple[dict[str, Any], list[Row]]:
    """Load a pytest-benchmark JSON; return (raw data, rows with ratios filled in)."""
    data = load_json(path)
    rows = parse_rows(data)
    compute_ratios(rows)
    return data, rows


# --------------------------------------------------------------------------- ratios


def group_cases(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Categorized rows grouped by case; cases and rows keep input order."""
    cases: dict[str, list[Row]] = {}
    for row in rows:
        if row.categorized:
            cases.setdefault(row.case, []).append(row)  # type: ignore[arg-type]
    return cases


def _ratio(reference: Row | None, row: Row) -> float | None:
    if reference is None or reference.seconds <= 0 or row.seconds <= 0:
        return None
    return reference.seconds / row.seconds


def compute_ratios(rows: Sequence[Row]) -> None:
    """Fill ``vs_stock``, ``stock_best`` and ``vs_raw`` in place for every categorized row.

    vs stock: stock's fastest row of the same case (its best mode for the same data and direction:
    ``consolidated`` where it applies; a row checked WRONG never counts), whatever the row's own
    ``stock_mode`` says (a counterpart kept in the JSON for reference only): a ratio against one of
    stock's slower modes would flatter cudarecv. vs raw: the first raw row of the case.
    """
    for case_rows in group_cases(rows).values():
        stock = [r for r in case_rows if r.impl == "stock" and r.seconds > 0 and r.ok is not False]
        best = min(stock, key=lambda r: r.seconds) if stock else None
        raw = next((r for r in case_rows if r.impl == "raw"), None)
        for r in case_rows:
            r.vs_stock = _ratio(best, r)
            r.stock_best = None if best is None else best.mode
            r.vs_raw = _ratio(raw, r)


# --------------------------------------------------------------------------- formatting


def human_bytes(n: int) -> str:
    """Decimal size: 16777216 -> '16.8 MB' (1 MB = 1e6 bytes)."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000.0
        if value < 999.95 or unit == "PB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_time(seconds: float) -> str:
    """'1.23 us' below 10 us, '12.3 us' below 1 ms, else '4.56 ms'."""
    us = seconds * 1e6
    if us < 9.995:
        return f"{us:.2f} us"
    if us < 999.95:
        return f"{us:.1f} us"
    return f"{us / 1000.0:.2f} ms"


def format_gbps(row: Row) -> str:
    """GB/s with two decimals, '-' for rows without payload."""
    g = row.gbps
    return "-" if g is None else f"{g:.2f}"


def format_ratio(ratio: float | None) -> str:
    """'2.50x', or '-' when there is nothing to compare with."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def _format_date(text: str) -> str:
    """ISO timestamp from pytest-benchmark -> '2025-01-31 12:00:00 UTC' (as is if unparsable)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return text
    if when.utcoffset() is not None:
        when = when.astimezone(timezone.utc)
        return when.strftime("%Y-%m-%d %H:%M:%S UTC")
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _dict(value: object) -> dict[str, Any]:
    """``value`` if it is a dict (a JSON object), else an empty one."""
    return value if isinstance(value, dict) else {}


def header_line(data: dict[str, Any]) -> str:
    """One line describing the machine, date and commit from the JSON."""
    mi: dict[str, Any] = _dict(data.get("machine_info"))
    cpu: dict[str, Any] = _dict(mi.get("cpu"))
    parts = []
    host = " ".join(
        str(x) for x in (mi.get("node"), cpu.get("brand_raw") or mi.get("processor")) if x
    )
    if host:
        parts.append(host)
    if mi.get("gpu"):
        parts.append(str(mi["gpu"]))
    osname = " ".join(str(x) for x in (mi.get("system"), mi.get("machine")) if x)
    if osname:
        parts.append(osname)
    if mi.get("python_version"):
        parts.append(f"Python {mi['python_version']}")
    if data.get("datetime"):
        parts.append(_format_date(str(data["datetime"])))
    ci: dict[str, Any] = _dict(data.get("commit_info"))
    if ci.get("id") and ci["id"] != "unversioned":
        parts.append(f"commit {str(ci['id'])[:10]}{' (dirty)' if ci.get('dirty') else ''}")
    if data.get("version"):
        parts.append(f"pytest-benchmark {data['version']}")
    return "machine: " + (" | ".join(parts) if parts else "unknown")


COLUMNS = (
    "size (B)",
    "size",
    "leaves",
    "impl",
    "mode",
    "backend",
    "transport",
    "time",
    "GB/s",
    "vs stock",
    "vs raw",
    "link",
    "check",
)
LEFT = {"impl", "mode", "backend", "transport", "case", "check"}


def format_check(ok: bool | None) -> str:
    """The check cell: 'ok', 'WRONG' (the checked transfer delivered wrong values) or '-' (not checked)."""
    return "-" if ok is None else "ok" if ok else "WRONG"


def row_cells(row: Row) -> dict[str, str]:
    """The formatted cells of one categorized row, keyed by column name."""
    return {
        "case": row.case or "",
        "size (B)": str(row.nbytes),
        "size": human_bytes(row.nbytes),
        "leaves": "-" if row.leaves is None else str(row.leaves),
        "impl": row.impl or "",
        "mode": row.mode or "-",
        "backend": row.backend or "-",
        "transport": row.transport or "-",
        "time": format_time(row.seconds),
        "GB/s": format_gbps(row),
        "vs stock": format_ratio(row.vs_stock),
        "vs raw": format_ratio(row.vs_raw),
        "link": "-" if row.link_util is None else f"{row.link_util:.0%}",
        "check": format_check(row.ok),
    }


def _columns(rows: Sequence[Row]) -> list[str]:
    cols = list(COLUMNS)
    if not any(r.backend for r in rows if r.categorized):
        cols.remove("backend")
    if not any(r.transport for r in rows if r.categorized):
        cols.remove("transport")  # (JSON written before the same-host transports)
    if all(r.link_util is None for r in rows if r.categorized):
        cols.remove("link")  # only the fan-out benches across hosts measure their links
    return cols


def notes(data: dict[str, Any], rows: Sequence[Row]) -> list[str]:
    """The lines above the table: machine, how times, ratios and checks read, and any legacy rows."""
    out = [header_line(data), NOTE, RATIO_NOTE, CHECK_NOTE]
    if any(r.link_util is not None for r in rows):
        out.append(LINK_NOTE)
    legacy = sum(r.legacy for r in rows)
    if legacy:
        out.append(LEGACY_NOTE.format(n=legacy))
    return out


def best_vs_stock(rows: Sequence[Row]) -> dict[str, Row]:
    """Per case, its cudarecv row with the highest ``vs stock`` among the rows not checked WRONG."""
    out = {}
    for case, group in group_cases(rows).items():
        candidates = [
            r
            for r in group
            if r.impl == "cudarecv" and r.vs_stock is not None and r.ok is not False
        ]
        if candidates:
            out[case] = max(candidates, key=lambda r: r.vs_stock)  # type: ignore[arg-type, return-value]
    return out


def summary(rows: Sequence[Row]) -> list[str]:
    """The closing lines: rows and checks, the wrong rows by name, the best cudarecv ratio vs stock per case."""
    categorized = [r for r in rows if r.categorized]
    cases = group_cases(rows)
    other = len(rows) - len(categorized)
    wrong = [r for r in categorized if r.ok is False]
    ok = sum(r.ok is True for r in categorized)
    lines = [
        f"rows: {len(categorized)} in {len(cases)} case(s)"
        + (f" (+{other} other)" if other else "")
        + f"; checked: {ok} ok, {len(wrong)} WRONG, {len(categorized) - ok - len(wrong)} not checked"
    ]
    if wrong:
        lines.append("WRONG values: " + "; ".join(f"{r.case}: {r.impl} {r.mode}" for r in wrong))
    best = best_vs_stock(rows)
    if best:
        lines.append(
            "best cudarecv vs stock per case (stock's fastest time / cudarecv's; WRONG rows excluded):"
        )
        lines += [
            f"  {case}: {format_ratio(r.vs_stock)} {r.mode} (vs stock {r.stock_best}, its fastest)"
            for case, r in best.items()
        ]
    else:
        lines.append(
            "best cudarecv vs stock: - (no case has a cudarecv row with a stock reference)"
        )
    return lines


def format_text(data: dict[str, Any], rows: Sequence[Row]) -> str:
    """Fixed-width table, one section per case, comment lines prefixed with '#', then the summary."""
    cases = group_cases(rows)
    out = table.text(
        _columns(rows),
        {case: [row_cells(r) for r in group] for case, group in cases.items()},
        left=LEFT,
        notes=notes(data, rows),
    )
    if not cases:
        out += "# (no benchmarks with extra_info case/impl)\n"
    other = [r for r in rows if not r.categorized]
    if other:
        out += "#\n" + table.text(
            ["name", "median"],
            {None: [{"name": r.name, "median": format_time(r.seconds)} for r in other]},
            left={"name"},
            notes=["other benchmarks (no case/impl extra_info)"],
        )
    return out + "#\n" + "".join(f"# {line}\n" for line in summary(rows))


def format_markdown(data: dict[str, Any], rows: Sequence[Row]) -> str:
    """GitHub markdown: a note paragraph, one table with a case column, the summary."""
    cols = ["case"] + _columns(rows)
    body = [row_cells(r) for g in group_cases(rows).values() for r in g]
    head = notes(data, rows)
    out = f"{head[0]}  \n" + "; ".join(head[1:]) + "\n\n" + table.markdown(cols, body, left=LEFT)
    other = [r for r in rows if not r.categorized]
    if other:
        out += "\nOther benchmarks:\n\n" + table.markdown(
            ["name", "median"],
            [{"name": r.name, "median": format_time(r.seconds)} for r in other],
            left={"name"},
        )
    lines = summary(rows)
    out += "\n" + "  \n".join(line for line in lines if not line.startswith("  ")) + "\n"
    per_case = [line.strip() for line in lines if line.startswith("  ")]
    if per_case:
        out += "\n" + "".join(f"- {line}\n" for line in per_case)
    return out


# --------------------------------------------------------------------------- plot

IMPL_COLORS = {"stock": "#1f77b4", "cudarecv": "#ff7f0e", "raw": "#7f7f7f"}
OTHER_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
MARKERS = "os^vD<>pP*hX"
LINESTYLES = ("-", "--", "-.", ":")
# a size in a case's name: "256MiB", "1GB", "8KiB" (not "2000" or "100k")
SIZE_IN_NAME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:[KMGTP]i?B|kB|B)(?!\w)")


def _measured(row: Row) -> float:
    """A plotted row's GB/s (panels hold measured rows only: :func:`panels`)."""
    assert row.gbps is not None
    return row.gbps


@dataclass
class Panel:
    """One subplot: ``kind`` "sizes" (GB/s vs payload size, a line per impl and mode, the cases of
    one family) or "modes" (one case of one size, a bar per row)."""

    title: str
    kind: str
    rows: list[Row]


def impl_color(impl: str | None, others: list[str]) -> str:
    """stock, cudarecv and raw keep their colours in every panel; other impls take the next free one."""
    if impl in IMPL_COLORS:
        return IMPL_COLORS[impl]
    if impl not in others:
        others.append(impl)  # type: ignore[arg-type]
    return OTHER_COLORS[others.index(impl) % len(OTHER_COLORS)]  # type: ignore[arg-type]


def panels(rows: Sequence[Row]) -> list[Panel]:
    """The plot's panels, in input order, from the categorized rows that move bytes.

    Cases whose names differ only in a size (``consolidated 1MiB``, ``consolidated 4MiB``...)
    form a family; a family of two sizes or more is one "sizes" panel, every other case
    one "modes" panel.
    """
    families: dict[str, list[Row]] = {}
    for r in rows:
        if r.categorized and r.gbps is not None:
            families.setdefault(SIZE_IN_NAME.sub("{size}", r.case), []).append(r)  # type: ignore[arg-type]
    out = []
    for template, family in families.items():
        cases = group_cases(family)
        if len({r.nbytes for r in family}) > 1:
            names = sorted(cases, key=lambda c: cases[c][0].nbytes)
            tokens = [m.group(0) for m in (SIZE_IN_NAME.search(c) for c in names) if m]
            title = f"{template.replace('{size}', 'N')} ({_where(family)})\nN = {', '.join(tokens)}"
            out.append(Panel(title, "sizes", family))
        else:
            for case, group in cases.items():
                out.append(
                    Panel(
                        f"{case}\n({human_bytes(group[0].nbytes)}, {_where(group)})", "modes", group
                    )
                )
    return out


def _where(rows: Sequence[Row]) -> str:
    """'200 leaves, gloo': the leaves and backends of a panel's rows."""
    leaves = sorted({r.leaves for r in rows if r.leaves is not None})
    parts = (
        [f"{leaves[0]} leaves" if len(leaves) == 1 else f"{leaves[0]}-{leaves[-1]} leaves"]
        if leaves
        else []
    )
    return ", ".join(parts + [b for b in dict.fromkeys(r.backend for r in rows) if b])


def _size_panel(ax: Any, panel: Panel, others: list[str]) -> None:
    lines: dict[tuple[str | None, str | None], list[Row]] = {}
    for r in panel.rows:
        lines.setdefault((r.impl, r.mode), []).append(r)
    modes = list(dict.fromkeys(r.mode for r in panel.rows))
    wrong_label = "WRONG values"
    for (impl, mode), points in lines.items():
        points = sorted(points, key=lambda r: r.nbytes)
        i = modes.index(mode)
        ax.plot(
            [r.nbytes for r in points],
            [r.gbps for r in points],
            color=impl_color(impl, others),
            marker=MARKERS[i % len(MARKERS)],
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            label=f"{impl} {mode}",
        )
        bad = [r for r in points if r.ok is False]
        if bad:
            ax.scatter(
                [r.nbytes for r in bad],
                [r.gbps for r in bad],
                marker="x",
                s=90,
                color="red",
                zorder=5,
                label=wrong_label,
            )
            wrong_label = "_nolegend_"
    sizes = sorted({r.nbytes for r in panel.rows})
    ax.set_xscale("log")
    ax.set_xticks(sizes, [human_bytes(n) for n in sizes])
    ax.minorticks_off()
    values = [_measured(r) for r in panel.rows]
    if min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)  # a linear axis from 0: heights compare as ratios
    ax.set_xlabel("payload per transfer (1 MB = 1e6 bytes)")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _mode_panel(ax: Any, panel: Panel, others: list[str]) -> None:
    from matplotlib.patches import Patch

    rows = panel.rows
    ys = list(range(len(rows)))[::-1]  # input order, top to bottom
    values = [_measured(r) for r in rows]
    ax.barh(ys, values, color=[impl_color(r.impl, others) for r in rows], height=0.7)
    ax.set_yticks(ys, [f"{r.impl} {r.mode}" for r in rows], fontsize=7)
    top = max(values)
    for y, r, gbps in zip(ys, rows, values):
        wrong = r.ok is False
        ax.text(
            gbps + top * 0.01,
            y,
            f"{gbps:.2f}" + ("  WRONG" if wrong else ""),
            va="center",
            fontsize=7,
            color="red" if wrong else "black",
        )
    ax.set_xlim(0, top * 1.2)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("GB/s")
    ax.grid(True, axis="x", alpha=0.3)
    impls = list(dict.fromkeys(r.impl for r in rows))
    ax.legend(
        handles=[Patch(color=impl_color(i, others), label=i) for i in impls],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )


def plot_figure(data: dict[str, Any], rows: Sequence[Row]) -> Any:
    """The plot as a matplotlib Figure (Agg canvas), one axes per :func:`panels` entry; None if no row
    moves bytes. Raises ImportError when matplotlib is missing."""
    todo = panels(rows)
    if not todo:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 1 if len(todo) == 1 else 2
    nrows = math.ceil(len(todo) / ncols)
    heights = [
        max(
            3.4 if p.kind == "sizes" else 1.4 + 0.28 * len(p.rows)
            for p in todo[i * ncols : (i + 1) * ncols]
        )
        for i in range(nrows)
    ]
    fig = Figure(figsize=(8.5 * ncols, sum(heights) + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(nrows, ncols, height_ratios=heights)
    others: list[str] = []
    for i, panel in enumerate(todo):
        ax = fig.add_subplot(grid[i // ncols, i % ncols])
        (_size_panel if panel.kind == "sizes" else _mode_panel)(ax, panel, others)
        ax.set_title(panel.title, fontsize=9)
    subtitle = "\n".join(textwrap.wrap(header_line(data), 150))
    fig.suptitle(
        f"cudarecv benchmarks: GB/s = bytes / time / 1e9, time = median of the bench's rounds "
        f"(colour: impl; marker and line style: mode)\n{subtitle}",
        fontsize=9,
    )
    return fig


def plot_png(data: dict[str, Any], rows: Sequence[Row], out: Path) -> bool:
    """Write :func:`plot_figure` to ``out``; False (writing nothing) when no row moves bytes.

    Raises ImportError when matplotlib is missing.
    """
    fig = plot_figure(data, rows)
    if fig is None:
        return False
    fig.savefig(out, format="png", dpi=110)
    return True


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand."""
    p = subparsers.add_parser(
        "report",
        help="print an nccl-tests style table (and a PNG plot) from a pytest-benchmark JSON",
    )
    p.add_argument("bench_json", metavar="BENCH.json", help="output of pytest --benchmark-json")
    png = p.add_mutually_exclusive_group()
    png.add_argument(
        "--png", metavar="OUT.png", help="plot path (default: BENCH.json with a .png suffix)"
    )
    png.add_argument("--no-png", action="store_true", help="do not write a plot")
    p.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the table, write the plot; 2 on bad input, 1 if the plot fails."""
    try:
        data, rows = load_rows(args.bench_json)
    except ReportError as exc:
        error("report", str(exc))
        return 2
    sys.stdout.write(format_markdown(data, rows) if args.markdown else format_text(data, rows))
    sys.stdout.flush()
    if args.no_png:
        return 0
    out = Path(args.png) if args.png else Path(args.bench_json).with_suffix(".png")
    try:
        wrote = plot_png(data, rows, out)
    except ImportError:
        error("report", f"matplotlib is needed for the plot: {MATPLOTLIB_HINT} (or pass --no-png)")
        return 1
    except OSError as exc:
        error("report", f"cannot write {out}: {exc.strerror or exc}")
        return 1
    if wrote:
        print(f"plot written to {out}", file=sys.stderr)
    else:
        print("no benchmark moves bytes (bytes > 0); no plot written", file=sys.stderr)
    return 0
