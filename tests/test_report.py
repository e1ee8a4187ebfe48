"""Tests for ``python -m cudarecv report`` (cudarecv/tools/report.py) and the benches' virtual clock."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cudarecv.tools import report as _report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KIB8_BYTES = 2000 * 8192  # 16384000
MIB256_BYTES = 256 * 2**20  # 268435456


# --------------------------------------------------------------------------- synthetic input


def _bench(name: str, median: float, **extra) -> dict:
    """One entry shaped like pytest-benchmark 5's ``benchmarks[*]``."""
    return {
        "group": None,
        "name": name,
        "fullname": f"bench/test_transfer.py::{name}",
        "params": None,
        "param": None,
        "extra_info": extra,
        "options": {
            "disable_gc": False,
            "timer": "perf_counter",
            "min_rounds": 5,
            "max_time": 1.0,
            "min_time": 5e-06,
            "precision": None,
            "confidence": None,
            "warmup": False,
        },
        "stats": {
            "min": median * 0.9,
            "max": median * 1.2,
            "mean": median * 1.05,
            "stddev": median * 0.05,
            "rounds": 7,
            "median": median,
            "iqr": median * 0.1,
            "q1": median * 0.95,
            "q3": median * 1.05,
            "iqr_outliers": 0,
            "stddev_outliers": 1,
            "outliers": "1;0",
            "ld15iqr": median * 0.9,
            "hd15iqr": median * 1.2,
            "ops": 1.0 / median,
            "total": median * 7,
            "iterations": 1,
        },
    }


def _doc(benchmarks: list[dict]) -> dict:
    """Top level shaped like pytest-benchmark 5's JSON."""
    return {
        "machine_info": {
            "node": "gpubox",
            "processor": "x86_64",
            "machine": "x86_64",
            "python_compiler": "GCC",
            "python_implementation": "CPython",
            "python_version": "3.11.7",
            "release": "6.1",
            "system": "Linux",
            "cpu": {"brand_raw": "Test CPU", "count": 16},
        },
        "commit_info": {
            "id": "0123456789abcdef",
            "time": None,
            "author_time": None,
            "dirty": True,
            "project": "cudarecv",
            "branch": "main",
        },
        "benchmarks": benchmarks,
        "datetime": "2025-03-01T12:34:56.789012+00:00",
        "version": "5.3.1",
    }


def _sample() -> dict:
    c1 = dict(case="2000 x 8KiB", bytes=KIB8_BYTES, leaves=2000)
    c2 = dict(case="consolidated 256MiB", bytes=MIB256_BYTES, leaves=1)
    return _doc(
        [
            _bench("test_stock_per_leaf", 0.010, impl="stock", mode="per-leaf", ok=True, **c1),
            _bench(
                "test_cudarecv_per_leaf", 0.004, impl="cudarecv", mode="per-leaf", ok=True, **c1
            ),
            _bench("test_raw_flat", 0.005, impl="raw", mode="flat recv", ok=True, **c1),
            _bench("test_raw_chunks", 0.001, impl="raw", mode="chunks 1MiB", **c1),
            # the fastest cudarecv row of its case, but its checked transfer was wrong
            _bench(
                "test_cudarecv_pseudo_rand",
                0.0025,
                impl="cudarecv",
                mode="per-leaf pseudo_rand",
                stock_mode="per-leaf",
                ok=False,
                **c1,
            ),
            _bench("test_stock_consolidated", 0.2, impl="stock", mode="consolidated", **c2),
            # an older JSON's row: extra_info.seconds (50 ms) wins over its stats.median (100 ms)
            _bench(
                "test_cudarecv_consolidated",
                0.1,
                impl="cudarecv",
                mode="consolidated",
                seconds=0.05,
                backend="gloo",
                ok=True,
                **c2,
            ),
            _bench(
                "test_tags",
                0.0000123,
                case="tags 100k",
                impl="cudarecv",
                mode="tags",
                bytes=0,
                leaves=0,
            ),
            _bench("test_plain", 0.0000005),
        ]
    )


def _sweep() -> dict:
    """A size sweep (one family: three cases), a single-size case and a row without bytes."""
    benches = []
    for mib, stock, ours in ((1, 0.001, 0.002), (4, 0.003, 0.004), (16, 0.010, 0.008)):
        common = dict(case=f"consolidated {mib}MiB", bytes=mib << 20, leaves=200, backend="gloo")
        benches += [
            _bench(f"stock-{mib}", stock, impl="stock", mode="consolidated", ok=True, **common),
            _bench(f"raw-{mib}", stock * 0.9, impl="raw", mode="flat recv", ok=True, **common),
            _bench(
                f"ours-{mib}",
                ours,
                impl="cudarecv",
                mode="chunks 1MiB",
                stock_mode="consolidated",
                ok=mib != 4,
                **common,
            ),
        ]
    one = dict(case="2000 x 8KiB", bytes=KIB8_BYTES, leaves=2000, backend="gloo")
    benches += [
        _bench("stock-leaf", 0.05, impl="stock", mode="per-leaf", **one),
        _bench("ours-leaf", 0.04, impl="cudarecv", mode="per-leaf", **one),
        _bench(
            "ours-buckets",
            0.015,
            impl="cudarecv",
            mode="buckets 1MiB",
            stock_mode="per-leaf",
            **one,
        ),
        _bench("tags", 0.001, case="tags 100k", impl="cudarecv", mode="tags", bytes=0, leaves=0),
    ]
    return _doc(benches)


@pytest.fixture
def bench_json(tmp_path: Path) -> Path:
    path = tmp_path / "BENCH.json"
    path.write_text(json.dumps(_sample()))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    return subprocess.run(
        [sys.executable, "-m", "cudarecv", "report", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _line(text: str, *needles: str) -> str:
    """The single line of text containing all needles."""
    found = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    assert len(found) == 1, (needles, found, text)
    return found[0]


def _summary(text: str) -> list[str]:
    """The summary: the comment lines after the last table row."""
    lines = text.splitlines()
    last_row = max(i for i, ln in enumerate(lines) if ln.startswith("  "))
    return [ln[2:] for ln in lines[last_row + 1 :] if ln.startswith("# ")]


def _row(text: str, impl: str, mode: str) -> list[str]:
    """Cells (split on 2+ spaces) of the single table row with this impl and mode."""
    found = []
    for ln in text.splitlines():
        cells = re.split(r"\s{2,}", ln.strip())
        if not ln.startswith("#") and len(cells) > 4 and cells[3:5] == [impl, mode]:
            found.append(cells)
    assert len(found) == 1, (impl, mode, text)
    return found[0]


def _run_inprocess(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    _report.register(parser.add_subparsers())
    return _report.run(parser.parse_args(["report", *argv]))


# --------------------------------------------------------------------------- pure functions


def test_human_bytes():
    assert _report.human_bytes(0) == "0 B"
    assert _report.human_bytes(999) == "999 B"
    assert _report.human_bytes(8192) == "8.2 kB"
    assert _report.human_bytes(16 * 2**20) == "16.8 MB"
    assert _report.human_bytes(MIB256_BYTES) == "268.4 MB"
    assert _report.human_bytes(999_999) == "1.0 MB"
    assert _report.human_bytes(4 * 10**9) == "4.0 GB"


def test_format_time_and_ratio():
    assert _report.format_time(5e-7) == "0.50 us"
    assert _report.format_time(1.23e-5) == "12.3 us"
    assert _report.format_time(0.004) == "4.00 ms"
    assert _report.format_time(1.5) == "1500.00 ms"
    assert _report.format_ratio(None) == "-"
    assert _report.format_ratio(2.5) == "2.50x"


def test_parse_rows_and_ratios():
    rows = _report.parse_rows(_sample())
    _report.compute_ratios(rows)
    by = {r.name: r for r in rows}
    assert [r.name for r in rows][:2] == ["test_stock_per_leaf", "test_cudarecv_per_leaf"]

    cr = by["test_cudarecv_per_leaf"]
    assert cr.gbps == pytest.approx(KIB8_BYTES / 0.004 / 1e9)
    assert cr.vs_stock == pytest.approx(2.5)
    assert cr.vs_raw == pytest.approx(1.25)  # first raw row of the case (0.005), not the 0.001 one
    pr = by["test_cudarecv_pseudo_rand"]
    assert pr.vs_stock == pytest.approx(4.0)  # stock's fastest (its only) row, per-leaf
    assert pr.vs_raw == pytest.approx(2.0)
    assert by["test_raw_flat"].vs_stock == pytest.approx(2.0)  # stock's fastest row: per-leaf
    assert by["test_raw_flat"].vs_raw == pytest.approx(1.0)
    assert by["test_stock_per_leaf"].vs_stock == pytest.approx(1.0)

    assert by["test_stock_per_leaf"].ok is True and by["test_cudarecv_pseudo_rand"].ok is False
    assert by["test_raw_chunks"].ok is None and not by["test_raw_chunks"].legacy
    assert by["test_cudarecv_per_leaf"].seconds == 0.004  # stats.median
    cons = by["test_cudarecv_consolidated"]
    assert cons.seconds == 0.05 and cons.legacy and cons.backend == "gloo"
    assert cons.vs_stock == pytest.approx(4.0)
    assert cons.vs_raw is None

    tags = by["test_tags"]
    assert tags.gbps is None and tags.vs_stock is None and tags.vs_raw is None
    assert not by["test_plain"].categorized
    assert list(_report.group_cases(rows)) == ["2000 x 8KiB", "consolidated 256MiB", "tags 100k"]


def test_vs_stock_divides_by_stocks_fastest_mode():
    """A case with stock per-leaf (100 ms), consolidated (10 ms) and a faster consolidated row checked WRONG
    (1 ms): every row's vs stock divides the right consolidated row's time, whatever its own stock_mode says."""
    case = dict(case="2000 x 8KiB", bytes=KIB8_BYTES, leaves=2000)
    rows = _report.parse_rows(
        _doc(
            [
                _bench("stock-leaf", 0.100, impl="stock", mode="per-leaf", ok=True, **case),
                _bench("stock-cons", 0.010, impl="stock", mode="consolidated", ok=True, **case),
                _bench("stock-bad", 0.001, impl="stock", mode="pseudo", ok=False, **case),
                _bench("raw", 0.008, impl="raw", mode="flat recv", ok=True, **case),
                _bench(
                    "ours",
                    0.020,
                    impl="cudarecv",
                    mode="buckets 1MiB",
                    stock_mode="per-leaf",
                    ok=True,
                    **case,
                ),
            ]
        )
    )
    _report.compute_ratios(rows)
    by = {r.name: r for r in rows}
    assert by["ours"].vs_stock == pytest.approx(0.5)  # not 5.00x against stock's per-leaf
    assert by["ours"].stock_best == "consolidated"
    assert by["stock-leaf"].vs_stock == pytest.approx(0.1)
    assert by["raw"].vs_stock == pytest.approx(1.25)
    assert _report.summary(rows)[-1] == (
        "  2000 x 8KiB: 0.50x buckets 1MiB (vs stock consolidated, its fastest)"
    )


def test_panels_group_size_families():
    rows = _report.parse_rows(_sweep())
    panels = _report.panels(rows)
    assert [(p.kind, len(p.rows)) for p in panels] == [
        ("sizes", 9),
        ("modes", 3),
    ]  # tags: no bytes, no panel
    sizes, modes = panels
    assert sizes.title == "consolidated N (200 leaves, gloo)\nN = 1MiB, 4MiB, 16MiB"
    assert modes.title == "2000 x 8KiB\n(16.4 MB, 2000 leaves, gloo)"
    # one case of one size is a "modes" panel, even when its name holds a size
    sample = _report.panels(_report.parse_rows(_sample()))
    assert [(p.kind, len(p.rows)) for p in sample] == [("modes", 5), ("modes", 2)]
    assert not any(r.case == "tags 100k" for p in sample for r in p.rows)


def test_plot_figure_panels_colours_legends():
    pytest.importorskip("matplotlib")
    rows = _report.parse_rows(_sweep())
    fig = _report.plot_figure(_sweep(), rows)
    assert len(fig.axes) == 2
    sizes_ax, modes_ax = fig.axes
    assert sizes_ax.get_title().startswith("consolidated N")
    assert sizes_ax.get_xscale() == "log"
    lines = {line.get_label(): line for line in sizes_ax.get_lines()}
    assert set(lines) == {"stock consolidated", "raw flat recv", "cudarecv chunks 1MiB"}
    for label, line in lines.items():
        assert line.get_color() == _report.IMPL_COLORS[label.split()[0]]  # colour = impl
        assert len(line.get_xdata()) == 3
    assert len({line.get_marker() for line in lines.values()}) == 3  # marker = mode
    legend = [t.get_text() for t in sizes_ax.get_legend().get_texts()]
    assert set(legend) == set(lines) | {"WRONG values"}  # the 4MiB cudarecv row was checked WRONG
    bars = modes_ax.patches
    assert len(bars) == 3
    assert [b.get_width() for b in bars] == pytest.approx(
        [KIB8_BYTES / t / 1e9 for t in (0.05, 0.04, 0.015)]
    )
    from matplotlib.colors import to_hex

    assert [to_hex(b.get_facecolor()) for b in bars] == [
        _report.IMPL_COLORS[i] for i in ("stock", "cudarecv", "cudarecv")
    ]
    assert [t.get_text() for t in modes_ax.get_legend().get_texts()] == ["stock", "cudarecv"]
    assert [t.get_text() for t in modes_ax.get_yticklabels()] == [
        "stock per-leaf",
        "cudarecv per-leaf",
        "cudarecv buckets 1MiB",
    ]
    assert (
        _report.plot_figure(_doc([_bench("x", 1.0)]), _report.parse_rows(_doc([_bench("x", 1.0)])))
        is None
    )


def test_summary_checks_and_best_ratio():
    rows = _report.parse_rows(_sample())
    _report.compute_ratios(rows)
    lines = _report.summary(rows)
    assert lines[0] == "rows: 8 in 3 case(s) (+1 other); checked: 4 ok, 1 WRONG, 3 not checked"
    assert lines[1] == "WRONG values: 2000 x 8KiB: cudarecv per-leaf pseudo_rand"
    assert lines[2].startswith("best cudarecv vs stock per case")
    # pseudo_rand (4.00x) was WRONG: the best right row is per-leaf; tags have no stock row
    assert lines[3:] == [
        "  2000 x 8KiB: 2.50x per-leaf (vs stock per-leaf, its fastest)",
        "  consolidated 256MiB: 4.00x consolidated (vs stock consolidated, its fastest)",
    ]
    none = _report.parse_rows(
        _doc([_bench("a", 1.0, case="c", impl="cudarecv", mode="m", bytes=1)])
    )
    _report.compute_ratios(none)
    assert _report.summary(none)[-1].startswith("best cudarecv vs stock: -")


def test_format_markdown_structure():
    rows = _report.parse_rows(_sample())
    _report.compute_ratios(rows)
    md = _report.format_markdown(_sample(), rows)
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0] == (
        "| case | size (B) | size | leaves | impl | mode | backend | time | GB/s | vs stock | vs raw "
        "| check |"
    )
    assert set(table[1]) <= set("|-:")
    assert all(ln.count("|") == table[0].count("|") for ln in table[:10])
    assert (
        "| 2000 x 8KiB | 16384000 | 16.4 MB | 2000 | cudarecv | per-leaf | - | 4.00 ms | 4.10 | 2.50x | 1.25x "
        "| ok |"
    ) in md
    assert "| per-leaf pseudo_rand | - | 2.50 ms | 6.55 | 4.00x | 2.00x | WRONG |" in md
    assert "| test_plain | 0.50 us |" in md
    assert "rows: 8 in 3 case(s) (+1 other); checked: 4 ok, 1 WRONG, 3 not checked  \n" in md
    assert "- 2000 x 8KiB: 2.50x per-leaf (vs stock per-leaf, its fastest)\n" in md
    assert _report.LEGACY_NOTE.format(n=1) in md


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ('{"machine_info": {}}', "no 'benchmarks' list"),
        ("[1, 2]", "no 'benchmarks' list"),
        ('{"benchmarks": [{"name": "x", "stats": {}}]}', "stats.median"),
        (
            '{"benchmarks": [{"name": "x", "stats": {"median": 1}, "extra_info": {"ok": "yes"}}]}',
            "extra_info.ok",
        ),
        (
            '{"benchmarks": [{"name": "x", "stats": {"median": 1}, "extra_info": {"seconds": "1"}}]}',
            "extra_info.seconds",
        ),
    ],
)
def test_load_errors(tmp_path: Path, content, needle):
    path = tmp_path / "b.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(_report.ReportError, match=needle):
        _report.load_rows(path)


def test_header_line():
    line = _report.header_line(_sample())
    assert "gpubox" in line and "Test CPU" in line and "2025-03-01 12:34:56 UTC" in line
    assert "commit 0123456789 (dirty)" in line


# --------------------------------------------------------------------------- CLI


def test_cli_text_table_and_png(bench_json: Path):
    proc = _cli(str(bench_json))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert _line(out, "machine:").startswith("# machine: gpubox")
    assert "# " + _report.NOTE in out
    assert "# " + _report.CHECK_NOTE in out
    assert "# " + _report.LEGACY_NOTE.format(n=1) in out

    # cells: size (B), size, leaves, impl, mode, backend, time, GB/s, vs stock, vs raw, check
    assert _row(out, "cudarecv", "per-leaf") == [
        "16384000",
        "16.4 MB",
        "2000",
        "cudarecv",
        "per-leaf",
        "-",
        "4.00 ms",
        "4.10",
        "2.50x",
        "1.25x",
        "ok",
    ]
    assert _row(out, "stock", "per-leaf")[-5:] == ["10.00 ms", "1.64", "1.00x", "0.50x", "ok"]
    assert _row(out, "cudarecv", "per-leaf pseudo_rand")[-4:] == ["6.55", "4.00x", "2.00x", "WRONG"]
    assert _row(out, "raw", "flat recv")[-4:] == ["3.28", "2.00x", "1.00x", "ok"]
    assert _row(out, "raw", "chunks 1MiB")[-4:] == ["16.38", "10.00x", "5.00x", "-"]
    assert _row(out, "cudarecv", "consolidated") == [
        "268435456",
        "268.4 MB",
        "1",
        "cudarecv",
        "consolidated",
        "gloo",
        "50.00 ms",
        "5.37",
        "4.00x",
        "-",
        "ok",
    ]
    assert _row(out, "stock", "consolidated")[-5:] == ["200.00 ms", "1.34", "1.00x", "-", "-"]
    assert _row(out, "cudarecv", "tags") == [
        "0",
        "0 B",
        "0",
        "cudarecv",
        "tags",
        "-",
        "12.3 us",
        "-",
        "-",
        "-",
        "-",
    ]
    assert _line(out, "test_plain").split() == ["test_plain", "0.50", "us"]

    # cases appear in input order, and the fixed-width columns line up
    assert (
        out.index("# case: 2000 x 8KiB")
        < out.index("# case: consolidated 256MiB")
        < out.index("# case: tags 100k")
    )
    data_lines = [ln for ln in out.splitlines() if ln.startswith("  ") and "test_plain" not in ln]
    assert len(data_lines) == 8
    header = _line(out, "size (B)", "vs raw")
    col_end = header.index("GB/s") + len("GB/s")
    assert all(ln[col_end - 1] != " " and ln[col_end] == " " for ln in data_lines)

    # the summary closes the text output, after the other benchmarks
    rows = _report.parse_rows(_sample())
    _report.compute_ratios(rows)
    assert _summary(out) == _report.summary(rows)
    assert (
        out.rstrip().splitlines()[-1]
        == "#   consolidated 256MiB: 4.00x consolidated (vs stock consolidated, its fastest)"
    )

    png = bench_json.with_suffix(".png")
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_cli_markdown_explicit_png(bench_json: Path, tmp_path: Path):
    out_png = tmp_path / "plot.png"
    proc = _cli(str(bench_json), "--markdown", "--png", str(out_png))
    assert proc.returncode == 0, proc.stderr
    assert (
        "| consolidated 256MiB | 268435456 | 268.4 MB | 1 | cudarecv | consolidated | gloo | 50.00 ms | 5.37 "
        "| 4.00x | - | ok |"
    ) in proc.stdout
    assert _report.NOTE in proc.stdout
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert not bench_json.with_suffix(".png").exists()


def test_cli_no_png(bench_json: Path):
    proc = _cli(str(bench_json), "--no-png")
    assert proc.returncode == 0, proc.stderr
    assert "5.37" in proc.stdout
    assert not bench_json.with_suffix(".png").exists()


@pytest.mark.parametrize("content", [None, "{not json", '{"foo": 1}'])
def test_cli_bad_input_exit_2(tmp_path: Path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    proc = _cli(str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("cudarecv report: error: ") and "bad.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "the following arguments are required: BENCH.json"),
        (
            ["B.json", "--png", "x.png", "--no-png"],
            "argument --no-png: not allowed with argument --png",
        ),
        (["B.json", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_cli_bad_options_exit_2(capsys, argv, needle):
    from cudarecv.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["report", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"cudarecv report: error: {needle}"


def test_cli_plot_cannot_be_written_exit_1(bench_json: Path, tmp_path: Path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "no such folder" / "plot.png"
    assert _run_inprocess(str(bench_json), "--png", str(target)) == 1
    captured = capsys.readouterr()
    assert "# case: 2000 x 8KiB" in captured.out  # the table came out first
    assert (
        captured.err.strip()
        == f"cudarecv report: error: cannot write {target}: No such file or directory"
    )


def test_inprocess_run_no_transfer_rows(tmp_path: Path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(_doc([_bench("test_only", 0.002)])))
    assert _run_inprocess(str(path)) == 0
    captured = capsys.readouterr()
    assert "test_only  2.00 ms" in captured.out
    assert "no plot written" in captured.err
    assert not path.with_suffix(".png").exists()


def test_matplotlib_lazy_and_missing(bench_json: Path):
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import argparse\n"
        "from cudarecv.tools import report as _report\n"
        "assert 'matplotlib' not in sys.modules, 'imported at module import'\n"
        "p = argparse.ArgumentParser(); _report.register(p.add_subparsers())\n"
        f"assert _report.run(p.parse_args(['report', {str(bench_json)!r}, '--no-png'])) == 0\n"
        "assert 'matplotlib' not in sys.modules, 'imported without a plot'\n"
        "sys.modules['matplotlib'] = None  # simulate: not installed\n"
        f"sys.exit(_report.run(p.parse_args(['report', {str(bench_json)!r}])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    assert 'pip install "cudarecv[tools]"' in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "5.37" in proc.stdout  # the table still comes out first


def test_real_pytest_benchmark_json(tmp_path: Path):
    """The loader reads what pytest-benchmark really writes."""
    pytest.importorskip("pytest_benchmark")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tiny.py").write_text(
        "def test_tiny(benchmark):\n"
        "    benchmark.extra_info.update(case='tiny', impl='cudarecv', mode='per-leaf', bytes=4000, leaves=2)\n"
        "    benchmark(lambda: None)\n"
        "def test_bare(benchmark):\n"
        "    benchmark(lambda: None)\n"
    )
    out = tmp_path / "real.json"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")
    }  # (an xdist worker's too)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:cudarecv",
            "--rootdir",
            str(tmp_path),
            "--benchmark-json",
            str(out),
            "--benchmark-min-rounds=1",
            "--benchmark-max-time=0.0001",
            "--benchmark-warmup=off",
            "test_tiny.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data, rows = _report.load_rows(out)
    by = {r.name: r for r in rows}
    tiny = by["test_tiny"]
    assert tiny.categorized and tiny.nbytes == 4000 and tiny.leaves == 2
    assert (
        tiny.seconds
        == data["benchmarks"][[b["name"] for b in data["benchmarks"]].index("test_tiny")]["stats"][
            "median"
        ]
    )
    assert not by["test_bare"].categorized
    text = _report.format_text(data, rows)
    assert "# case: tiny" in text and "test_bare" in text
    assert "pytest-benchmark" in _report.header_line(data)


REPLAYED = [0.003, 0.001, 0.002, 0.0045, 0.0025]  # seconds "measured in the ranks"


def test_virtual_clock_makes_pytest_benchmark_stats_the_measured_times(tmp_path: Path):
    """The benches' design: replayed through the virtual clock, pytest-benchmark's own stats (its table,
    its JSON) are exactly the times measured elsewhere, and the report reads the same median."""
    pytest.importorskip("pytest_benchmark")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_replay.py").write_text(
        "import pytest\n"
        "from cudarecv.tools import transfer_ranks as tb\n"
        "CLOCK = tb.VirtualClock('receiver_clock')\n"
        "@pytest.mark.benchmark(timer=CLOCK)\n"
        "def test_replayed(benchmark):\n"
        "    benchmark.extra_info.update(case='c', impl='cudarecv', mode='buckets 1MiB', bytes=4000000, leaves=2,\n"
        "                                ok=True)\n"
        f"    tb.replay(benchmark, CLOCK, {REPLAYED!r})\n"
        "def test_unmarked_is_refused(benchmark):\n"
        "    with pytest.raises(RuntimeError, match='mark it @pytest.mark.benchmark'):\n"
        "        tb.replay(benchmark, CLOCK, [1.0])\n"
        "    with pytest.raises(ValueError):\n"
        "        tb.replay(benchmark, CLOCK, [])\n"
    )
    out = tmp_path / "replay.json"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")
    }  # (an xdist worker's too)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:cudarecv",
            "-W",
            "ignore::pytest_benchmark.logger.PytestBenchmarkWarning",
            "--rootdir",
            str(tmp_path),
            "--benchmark-json",
            str(out),
            "--benchmark-columns=min,median,mean,rounds",
            "test_replay.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    [bench] = data["benchmarks"]  # the refused replay recorded nothing
    stats = bench["stats"]
    assert stats["data"] == REPLAYED  # exactly, float for float
    assert stats["rounds"] == len(REPLAYED) and stats["iterations"] == 1
    assert stats["min"] == 0.001 and stats["max"] == 0.0045
    assert stats["median"] == statistics.median(REPLAYED) == 0.0025
    assert stats["mean"] == statistics.mean(REPLAYED)
    assert bench["options"]["timer"] == "receiver_clock"
    # pytest-benchmark's own table (ms): min 1.0000, median 2.5000, mean 2.6000, 5 rounds
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("test_replayed")]
    assert line.split()[1:] == ["1.0000", "2.5000", "2.6000", "5"], line
    _, rows = _report.load_rows(out)
    assert rows[0].seconds == 0.0025 and not rows[0].legacy and rows[0].ok is True


def test_virtual_clock_moves_only_when_told():
    from cudarecv.tools import transfer_ranks as tb

    clock = tb.VirtualClock("c")
    assert clock() == 0.0 and clock() == 0.0
    clock.advance(0.25)
    assert clock() == 0.25
    clock.restart()
    assert clock() == 0.0
    assert clock.__name__ == "c" and repr(clock) == "VirtualClock('c')"


def test_link_column_only_for_rows_that_measured_their_links():
    case = dict(
        case="fan-out 64 MiB to K=4",
        bytes=64 << 20,
        backend="gloo",
        ok=True,
        stock_mode="init_remote + consolidated",
    )
    data = _doc(
        [
            _bench("relay", 0.66, impl="cudarecv", mode="relay", link_utilisation=0.821, **case),
            _bench(
                "stock",
                2.65,
                impl="stock",
                mode="init_remote + consolidated",
                link_utilisation=0.83,
                **case,
            ),
        ]
    )
    rows = _report.parse_rows(data)
    _report.compute_ratios(rows)
    text = _report.format_text(data, rows)
    header = next(line for line in text.splitlines() if line.startswith("# size (B)"))
    assert re.split(r"\s{2,}", header[2:].strip())[-2:] == ["link", "check"]
    relay = next(
        line for line in text.splitlines() if " relay " in line and not line.startswith("#")
    )
    assert re.split(r"\s{2,}", relay.strip())[-2:] == ["82%", "ok"], relay
    assert _report.LINK_NOTE in text
    plain = _report.parse_rows(_sample())
    _report.compute_ratios(plain)
    assert "link" not in _report._columns(plain) and _report.LINK_NOTE not in _report.format_text(
        _sample(), plain
    )
