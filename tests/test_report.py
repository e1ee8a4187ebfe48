"""Tests for ``python -m cudarecv report`` (cudarecv/_report.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
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
        "options": {"disable_gc": False, "timer": "perf_counter", "min_rounds": 5, "max_time": 1.0,
                    "min_time": 5e-06, "precision": None, "confidence": None, "warmup": False},
        "stats": {"min": median * 0.9, "max": median * 1.2, "mean": median * 1.05, "stddev": median * 0.05,
                  "rounds": 7, "median": median, "iqr": median * 0.1, "q1": median * 0.95, "q3": median * 1.05,
                  "iqr_outliers": 0, "stddev_outliers": 1, "outliers": "1;0", "ld15iqr": median * 0.9,
                  "hd15iqr": median * 1.2, "ops": 1.0 / median, "total": median * 7, "iterations": 1},
    }


def _doc(benchmarks: list[dict]) -> dict:
    """Top level shaped like pytest-benchmark 5's JSON."""
    return {
        "machine_info": {"node": "gpubox", "processor": "x86_64", "machine": "x86_64", "python_compiler": "GCC",
                         "python_implementation": "CPython", "python_version": "3.11.7", "release": "6.1",
                         "system": "Linux", "cpu": {"brand_raw": "Test CPU", "count": 16}},
        "commit_info": {"id": "0123456789abcdef", "time": None, "author_time": None, "dirty": True,
                        "project": "cudarecv", "branch": "main"},
        "benchmarks": benchmarks,
        "datetime": "2025-03-01T12:34:56.789012+00:00",
        "version": "5.3.1",
    }


def _sample() -> dict:
    c1 = dict(case="2000 x 8KiB", bytes=KIB8_BYTES, leaves=2000)
    c2 = dict(case="consolidated 256MiB", bytes=MIB256_BYTES, leaves=1)
    return _doc([
        _bench("test_stock_per_leaf", 0.010, impl="stock", mode="per-leaf", **c1),
        _bench("test_cudarecv_per_leaf", 0.004, impl="cudarecv", mode="per-leaf", **c1),
        _bench("test_raw_flat", 0.005, impl="raw", mode="flat recv", **c1),
        _bench("test_raw_chunks", 0.001, impl="raw", mode="chunks 1MiB", **c1),
        _bench("test_cudarecv_pseudo_rand", 0.0025, impl="cudarecv", mode="per-leaf pseudo_rand",
               stock_mode="per-leaf", **c1),
        _bench("test_stock_consolidated", 0.2, impl="stock", mode="consolidated", **c2),
        # timed in a child process: `seconds` (50 ms) wins over stats.median (100 ms)
        _bench("test_cudarecv_consolidated", 0.1, impl="cudarecv", mode="consolidated", seconds=0.05,
               backend="gloo", **c2),
        _bench("test_tags", 0.0000123, case="tags 100k", impl="cudarecv", mode="tags", bytes=0, leaves=0),
        _bench("test_plain", 0.0000005),
    ])


@pytest.fixture
def bench_json(tmp_path: Path) -> Path:
    path = tmp_path / "BENCH.json"
    path.write_text(json.dumps(_sample()))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    return subprocess.run([sys.executable, "-m", "cudarecv", "report", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _line(text: str, *needles: str) -> str:
    """The single line of text containing all needles."""
    found = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    assert len(found) == 1, (needles, found, text)
    return found[0]


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
    assert pr.vs_stock == pytest.approx(4.0)  # stock_mode="per-leaf"
    assert pr.vs_raw == pytest.approx(2.0)
    assert by["test_raw_flat"].vs_stock is None  # no stock "flat recv"
    assert by["test_raw_flat"].vs_raw == pytest.approx(1.0)
    assert by["test_stock_per_leaf"].vs_stock == pytest.approx(1.0)

    cons = by["test_cudarecv_consolidated"]
    assert cons.seconds == 0.05 and cons.backend == "gloo"
    assert cons.vs_stock == pytest.approx(4.0)
    assert cons.vs_raw is None

    tags = by["test_tags"]
    assert tags.gbps is None and tags.vs_stock is None and tags.vs_raw is None
    assert not by["test_plain"].categorized
    assert list(_report.group_cases(rows)) == ["2000 x 8KiB", "consolidated 256MiB", "tags 100k"]


def test_series_only_transfer_rows():
    rows = _report.parse_rows(_sample())
    s = _report.series(rows)
    assert not any(k.startswith("cudarecv tags") for k in s)
    assert s["cudarecv consolidated, 1 leaves (gloo)"] == [(MIB256_BYTES, pytest.approx(MIB256_BYTES / 0.05 / 1e9))]
    assert set(s) == {"stock per-leaf, 2000 leaves", "cudarecv per-leaf, 2000 leaves", "raw flat recv, 2000 leaves",
                      "raw chunks 1MiB, 2000 leaves", "cudarecv per-leaf pseudo_rand, 2000 leaves",
                      "stock consolidated, 1 leaves", "cudarecv consolidated, 1 leaves (gloo)"}


def test_format_markdown_structure():
    rows = _report.parse_rows(_sample())
    _report.compute_ratios(rows)
    md = _report.format_markdown(_sample(), rows)
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| case | size (B) | size | leaves | impl | mode | backend | time | GB/s |")
    assert set(table[1]) <= set("|-:")
    assert all(ln.count("|") == table[0].count("|") for ln in table[:10])
    assert "| 2000 x 8KiB | 16384000 | 16.4 MB | 2000 | cudarecv | per-leaf | - | 4.00 ms | 4.10 | 2.50x | 1.25x |" in md
    assert "| test_plain | 0.50 us |" in md


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    ('{"machine_info": {}}', "no 'benchmarks' list"),
    ("[1, 2]", "no 'benchmarks' list"),
    ('{"benchmarks": [{"name": "x", "stats": {}}]}', "stats.median"),
])
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

    # cells: size (B), size, leaves, impl, mode, backend, time, GB/s, vs stock, vs raw
    assert _row(out, "cudarecv", "per-leaf") == \
        ["16384000", "16.4 MB", "2000", "cudarecv", "per-leaf", "-", "4.00 ms", "4.10", "2.50x", "1.25x"]
    assert _row(out, "stock", "per-leaf")[-4:] == ["10.00 ms", "1.64", "1.00x", "0.50x"]
    assert _row(out, "cudarecv", "per-leaf pseudo_rand")[-3:] == ["6.55", "4.00x", "2.00x"]
    assert _row(out, "raw", "flat recv")[-3:] == ["3.28", "-", "1.00x"]
    assert _row(out, "raw", "chunks 1MiB")[-3:] == ["16.38", "-", "5.00x"]
    assert _row(out, "cudarecv", "consolidated") == \
        ["268435456", "268.4 MB", "1", "cudarecv", "consolidated", "gloo", "50.00 ms", "5.37", "4.00x", "-"]
    assert _row(out, "stock", "consolidated")[-4:] == ["200.00 ms", "1.34", "1.00x", "-"]
    assert _row(out, "cudarecv", "tags") == ["0", "0 B", "0", "cudarecv", "tags", "-", "12.3 us", "-", "-", "-"]
    assert _line(out, "test_plain").split() == ["test_plain", "0.50", "us"]

    # cases appear in input order, and the fixed-width columns line up
    assert out.index("# case: 2000 x 8KiB") < out.index("# case: consolidated 256MiB") < out.index("# case: tags 100k")
    data_lines = [ln for ln in out.splitlines() if ln.startswith("  ") and "test_plain" not in ln]
    assert len(data_lines) == 8
    header = _line(out, "size (B)", "vs raw")
    col_end = header.index("GB/s") + len("GB/s")
    assert all(ln[col_end - 1] != " " and ln[col_end] == " " for ln in data_lines)

    png = bench_json.with_suffix(".png")
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_cli_markdown_explicit_png(bench_json: Path, tmp_path: Path):
    out_png = tmp_path / "plot.png"
    proc = _cli(str(bench_json), "--markdown", "--png", str(out_png))
    assert proc.returncode == 0, proc.stderr
    assert "| consolidated 256MiB | 268435456 | 268.4 MB | 1 | cudarecv | consolidated | gloo | 50.00 ms | 5.37 | 4.00x | - |" \
        in proc.stdout
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
    assert "Traceback" not in proc.stderr and "bad.json" in proc.stderr


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
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "pip install matplotlib or cudarecv[test]" in proc.stderr
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
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cudarecv",
         "--rootdir", str(tmp_path), "--benchmark-json", str(out), "--benchmark-min-rounds=1",
         "--benchmark-max-time=0.0001", "--benchmark-warmup=off", "test_tiny.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data, rows = _report.load_rows(out)
    by = {r.name: r for r in rows}
    tiny = by["test_tiny"]
    assert tiny.categorized and tiny.nbytes == 4000 and tiny.leaves == 2
    assert tiny.seconds == data["benchmarks"][[b["name"] for b in data["benchmarks"]].index("test_tiny")]["stats"]["median"]
    assert not by["test_bare"].categorized
    text = _report.format_text(data, rows)
    assert "# case: tiny" in text and "test_bare" in text
    assert "pytest-benchmark" in _report.header_line(data)
