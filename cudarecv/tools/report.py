"""``python -m cudarecv report``: turn a pytest-benchmark JSON into an nccl-tests style table.

Usage::

    pytest bench/ --benchmark-json BENCH.json
    python -m cudarecv report BENCH.json [--markdown] [--png OUT.png | --no-png]

Each of our benchmarks carries ``extra_info`` with ``case``, ``impl`` ("cudarecv",
"stock" or "raw"), ``mode``, ``bytes`` and ``leaves``, and optionally
``stock_mode``, ``seconds`` (reported instead of the median) and ``backend``.
Rows are grouped by case (input order); ``vs stock`` / ``vs raw`` are the
reference time divided by this row's time, so > 1 means this row is faster.

This module imports no other cudarecv module, and matplotlib only when plotting.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from . import table

NOTE = "time = extra_info seconds if given (timed inside the ranks), else median of rounds; GB/s = bytes / time / 1e9"
RATIO_NOTE = "vs stock / vs raw = their time / this time (> 1: this row is faster)"
MATPLOTLIB_HINT = "pip install matplotlib or cudarecv[test]"


class ReportError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


@dataclass
class Row:
    """One benchmark, with the time to report (``seconds`` override or median)."""

    name: str
    seconds: float
    case: str | None = None
    impl: str | None = None
    mode: str | None = None
    nbytes: int = 0
    leaves: int | None = None
    stock_mode: str | None = None
    backend: str | None = None
    vs_stock: float | None = None
    vs_raw: float | None = None

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
        if extra.get("seconds") is not None:
            seconds = _number(extra["seconds"], "extra_info.seconds", name)
        else:
            stats = bench.get("stats")
            median = stats.get("median") if isinstance(stats, dict) else None
            seconds = _number(median, "stats.median", name)
        leaves = extra.get("leaves")
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
    """Fill ``vs_stock`` and ``vs_raw`` in place for every categorized row.

    vs stock: the stock row of the same case whose mode is this row's
    ``stock_mode`` (default: its own mode). vs raw: the first raw row of the case.
    """
    for case_rows in group_cases(rows).values():
        stock = {}
        for r in case_rows:
            if r.impl == "stock":
                stock.setdefault(r.mode, r)
        raw = next((r for r in case_rows if r.impl == "raw"), None)
        for r in case_rows:
            wanted = r.stock_mode if r.stock_mode is not None else r.mode
            r.vs_stock = _ratio(stock.get(wanted), r)
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


def header_line(data: dict[str, Any]) -> str:
    """One line describing the machine, date and commit from the JSON."""
    mi = data.get("machine_info") if isinstance(data.get("machine_info"), dict) else {}
    cpu = mi.get("cpu") if isinstance(mi.get("cpu"), dict) else {}
    parts = []
    host = " ".join(str(x) for x in (mi.get("node"), cpu.get("brand_raw") or mi.get("processor")) if x)
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
    ci = data.get("commit_info") if isinstance(data.get("commit_info"), dict) else {}
    if ci.get("id") and ci["id"] != "unversioned":
        parts.append(f"commit {str(ci['id'])[:10]}{' (dirty)' if ci.get('dirty') else ''}")
    if data.get("version"):
        parts.append(f"pytest-benchmark {data['version']}")
    return "machine: " + (" | ".join(parts) if parts else "unknown")


COLUMNS = ("size (B)", "size", "leaves", "impl", "mode", "backend", "time", "GB/s", "vs stock", "vs raw")
LEFT = {"impl", "mode", "backend", "case"}


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
        "time": format_time(row.seconds),
        "GB/s": format_gbps(row),
        "vs stock": format_ratio(row.vs_stock),
        "vs raw": format_ratio(row.vs_raw),
    }


def _columns(rows: Sequence[Row]) -> list[str]:
    cols = list(COLUMNS)
    if not any(r.backend for r in rows if r.categorized):
        cols.remove("backend")
    return cols


def format_text(data: dict[str, Any], rows: Sequence[Row]) -> str:
    """Fixed-width table, one section per case, comment lines prefixed with '#'."""
    cases = group_cases(rows)
    notes = [header_line(data), NOTE, RATIO_NOTE]
    out = table.text(_columns(rows), {case: [row_cells(r) for r in group] for case, group in cases.items()},
                     left=LEFT, notes=notes)
    if not cases:
        out += "# (no benchmarks with extra_info case/impl)\n"
    other = [r for r in rows if not r.categorized]
    if other:
        out += "#\n" + table.text(["name", "median"], {None: [{"name": r.name, "median": format_time(r.seconds)}
                                                            for r in other]},
                                   left={"name"}, notes=["other benchmarks (no case/impl extra_info)"])
    return out


def format_markdown(data: dict[str, Any], rows: Sequence[Row]) -> str:
    """GitHub markdown: a note paragraph, then one table with a case column."""
    cols = ["case"] + _columns(rows)
    body = [row_cells(r) for g in group_cases(rows).values() for r in g]
    out = f"{header_line(data)}  \n{NOTE}; {RATIO_NOTE}\n\n" + table.markdown(cols, body, left=LEFT)
    other = [r for r in rows if not r.categorized]
    if other:
        out += "\nOther benchmarks:\n\n" + table.markdown(
            ["name", "median"], [{"name": r.name, "median": format_time(r.seconds)} for r in other], left={"name"})
    return out


# --------------------------------------------------------------------------- plot


def series(rows: Sequence[Row]) -> dict[str, list[tuple[int, float]]]:
    """(bytes, GB/s) points per 'impl mode, N leaves [backend]' label, sorted by size; bytes > 0 only."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        g = r.gbps
        if not r.categorized or g is None:
            continue
        label = f"{r.impl} {r.mode}, {r.leaves} leaves" + (f" ({r.backend})" if r.backend else "")
        out.setdefault(label, []).append((r.nbytes, g))
    return {k: sorted(v) for k, v in out.items()}


def plot_png(data: dict[str, Any], rows: Sequence[Row], out: Path) -> bool:
    """Write GB/s vs payload size (log x; log y too when values span > 100x).

    Returns False (writing nothing) when no row moves bytes. Raises ImportError
    when matplotlib is missing.
    """
    lines = series(rows)
    if not lines:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    markers = "os^vD<>pP*hX"
    for i, (label, points) in enumerate(lines.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=markers[i % len(markers)], label=label)
    ax.set_xscale("log")
    values = [y for pts in lines.values() for _, y in pts]
    if min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_bytes(int(round(x)))))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("payload size per round (1 MB = 1e6 bytes)")
    ax.set_ylabel("GB/s (bytes / time / 1e9)")
    subtitle = "\n".join(textwrap.wrap(header_line(data), 110))
    ax.set_title(f"cudarecv benchmarks: bandwidth vs payload size\n{subtitle}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, format="png", dpi=120)
    return True


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand."""
    p = subparsers.add_parser(
        "report",
        help="print an nccl-tests style table (and a PNG plot) from a pytest-benchmark JSON",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("bench_json", metavar="BENCH.json", help="output of pytest --benchmark-json")
    png = p.add_mutually_exclusive_group()
    png.add_argument("--png", metavar="OUT.png", help="plot path (default: BENCH.json with a .png suffix)")
    png.add_argument("--no-png", action="store_true", help="do not write a plot")
    p.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the table, write the plot; 2 on bad input, 1 if the plot fails."""
    try:
        data, rows = load_rows(args.bench_json)
    except ReportError as exc:
        print(f"cudarecv report: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_markdown(data, rows) if args.markdown else format_text(data, rows))
    sys.stdout.flush()
    if args.no_png:
        return 0
    out = Path(args.png) if args.png else Path(args.bench_json).with_suffix(".png")
    try:
        wrote = plot_png(data, rows, out)
    except ImportError:
        print(f"cudarecv report: error: matplotlib is needed for the plot: {MATPLOTLIB_HINT} "
              "(or pass --no-png)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cudarecv report: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if wrote:
        print(f"plot written to {out}", file=sys.stderr)
    else:
        print("no benchmark moves bytes (bytes > 0); no plot written", file=sys.stderr)
    return 0
