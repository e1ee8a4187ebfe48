"""``python -m cudarecv compare`` (cudarecv/tools/compare.py): a ``--quick`` smoke test in a subprocess, its
option errors, and the raw bucketing baseline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cudarecv.tools import cli
from cudarecv.tools import transfer_ranks as tb
from procs import HANG

ROOT = Path(__file__).resolve().parents[1]

# --quick: 64 leaves of 1 KiB, a 1 MiB consolidated tensordict, bucket_bytes 16 KiB
EXPECTED = {
    "64 x 1KiB": [
        ("stock", "per-leaf"),
        ("stock", "per-leaf pseudo_rand"),
        ("stock", "consolidated"),
        ("raw", "flat recv"),
        ("raw", "per-leaf dist.irecv"),
        ("raw", "buckets 16KiB"),
        ("cudarecv", "per-leaf"),
        ("cudarecv", "per-leaf pseudo_rand"),
        ("cudarecv", "consolidated"),
        ("cudarecv", "buckets 16KiB"),
        ("cudarecv", "chunks 16KiB"),
        ("cudarecv", "chunks 16KiB shared"),
        ("cudarecv", "buckets 16KiB wire"),
        ("cudarecv", "chunks 16KiB wire"),
    ],
    "consolidated 1MiB": [
        ("stock", "consolidated"),
        ("raw", "flat recv"),
        ("cudarecv", "consolidated"),
        ("cudarecv", "chunks 16KiB"),
        ("cudarecv", "chunks 16KiB wire"),
        ("cudarecv", "chunks 16KiB shared"),
        ("stock", "per-leaf"),
        ("cudarecv", "per-leaf"),
    ],
}


def _table(stdout: str) -> tuple[list[str], dict[str, list[dict[str, str]]]]:
    """The column names and, per case, the rows (cells by column) of the printed table."""
    columns: list[str] = []
    cases: dict[str, list[dict[str, str]]] = {}
    case = None
    for line in stdout.splitlines():
        if line.startswith("# size (B)"):
            columns = re.split(r"\s{2,}", line[2:].strip())
        elif line.startswith("# case: "):
            case = line[len("# case: ") :].strip()
            cases[case] = []
        elif line.strip() and not line.startswith("#"):
            assert case is not None and columns, f"table row before its header: {line!r}"
            cells = re.split(r"\s{2,}", line.strip())
            assert len(cells) == len(columns), f"row {line!r} does not match columns {columns}"
            cases[case].append(dict(zip(columns, cells)))
    return columns, cases


def test_compare_quick() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "cudarecv", "compare", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )

    columns, cases = _table(proc.stdout)
    for column in ("impl", "mode", "transport", "time", "GB/s", "vs stock", "vs raw", "check"):
        assert column in columns, f"no {column!r} column in {columns}"
    assert list(cases) == list(EXPECTED), proc.stdout
    for case, modes in EXPECTED.items():
        got = [(row["impl"], row["mode"]) for row in cases[case]]
        assert got == modes, f"{case}: rows {got}, expected {modes}\n{proc.stdout}"
        for row in cases[case]:
            assert row["check"] == "ok", f"{case}: {row}\n{proc.stdout}"
            assert row["time"] != "-" and float(row["time"].split()[0]) > 0, (
                row
            )  # GB/s may round to 0.00
            assert row["vs raw"].endswith("x"), row
            fast = row["impl"] == "cudarecv" and row["mode"].startswith(("buckets", "chunks"))
            shared = fast and not row["mode"].endswith(
                "wire"
            )  # both ranks are cudarecv on this machine
            assert row["transport"] == ("shared memory" if shared else "wire"), row
    raws = [
        row
        for rows in cases.values()
        for row in rows
        if row["impl"] == "raw" and row["mode"] == "flat recv"
    ]
    assert all(row["vs raw"] == "1.00x" for row in raws)
    total = sum(map(len, EXPECTED.values()))
    assert f"# checks: all {total} modes delivered the right values" in proc.stdout

    # one progress line per mode, flushed as each completes
    progress = [line for line in proc.stderr.splitlines() if re.match(rf"\[\s*\d+/{total}\]", line)]
    assert len(progress) == total, proc.stderr
    assert all(line.rstrip().endswith("ok") for line in progress), proc.stderr


def _main(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``python -m cudarecv compare ARGV``, in this process (bad options start no rank)."""
    try:
        code = cli.main(["compare", *argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    return code, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--bucket-bytes", "abc"],
            "argument --bucket-bytes: not a size: 'abc'; write it like 1MiB, 256KiB or 4096",
        ),
        (["--bucket-bytes", "0"], "argument --bucket-bytes: a size must be positive, got '0'"),
        (
            ["--leaf-bytes", "8 KB s"],
            "argument --leaf-bytes: not a size: '8 KB s'; write it like 1MiB, 256KiB or 4096",
        ),
        (
            ["--leaf-bytes", "1001"],
            "argument --leaf-bytes: must be a multiple of 4 bytes (float32 leaves), got 1001",
        ),
        (["--leaves", "0"], "argument --leaves: must be >= 1, got 0"),
        (["--leaves", "many"], "argument --leaves: not an integer: 'many'"),
        (["--consolidated-mib", "-1"], "argument --consolidated-mib: must be >= 0, got -1"),
        (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
        (["--quick", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_compare_bad_option(capsys, argv, message) -> None:
    code, err = _main(capsys, *argv)
    assert code == 2, err
    assert err.strip().splitlines()[-1] == f"cudarecv compare: error: {message}"
    assert "Traceback" not in err


def test_compare_bad_option_subprocess() -> None:
    """The real command line: exit status 2, argparse's usage, then the one error line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "cudarecv", "compare", "--bucket-bytes", "abc"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("usage: cudarecv compare")
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("cudarecv compare: error: argument --bucket-bytes: ")
    )


@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
def test_raw_buckets_baseline_delivers(cluster, standalone) -> None:
    """The hand-rolled bucketing baseline moves the right bytes (leaves split across pieces)."""
    case = dict(leaves=40, leaf_bytes=3000, impl="raw", mode="buckets 7KiB", iters=2, warmup=1)
    results = cluster().run(tb.time_case, args=(case,), standalone=standalone)
    receiver = results[1]
    assert receiver["ok"], receiver["error"]
    assert len(receiver["seconds"]) == 2
