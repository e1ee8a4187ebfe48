"""``python -m cudarecv compare``: stock tensordict vs cudarecv vs raw torch.distributed, on two local ranks.

Usage::

    python -m cudarecv compare [--leaves N] [--leaf-bytes SIZE] [--consolidated-mib MIB]
                               [--bucket-bytes SIZE] [--iters N] [--warmup N] [--rounds N] [--quick]

Starts two local processes on gloo loopback (one :class:`~cudarecv.testing.launch.Cluster`)
and transfers, from rank 0 to rank 1:

- a model-sized tensordict of ``--leaves`` float32 leaves of ``--leaf-bytes`` each,
  in every mode: stock, cudarecv and raw per-leaf ``isend/irecv``, per-leaf
  ``pseudo_rand``, ``consolidated``, cudarecv's fast wire ``buckets`` and
  ``chunks`` of ``--bucket-bytes``, and raw ``dist.send/recv`` of one flat buffer;
- one consolidated tensordict of ``--consolidated-mib`` MiB in 200 leaves
  (0 skips it): consolidated, chunks, flat, and per-leaf for reference.

One line per mode is printed (on stderr) as it completes, then an nccl-tests
style table (on stdout): the receiver's median time per transfer, GB/s
(1 GB = 1e9 B), the ratio to stock's fastest mode in the case (its best for the
same data: ``consolidated`` here, never a slower one) and to raw (the flat buffer), and ``check``: whether the values arrived intact, as
checked after the timed iterations. ``--rounds R`` repeats the whole list of
modes R times, alternating them, and reports medians over all rounds.

Exit status: 0 if every transfer delivered the right values, 1 if any did not
(or a rank failed), 2 on bad arguments. Errors print as ``cudarecv compare:
error: ...`` (see :mod:`cudarecv.tools.cli`); a bad option's names its flag.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..testing import table
from ..testing.launch import Cluster, RankError
from . import report
from . import transfer_ranks as tb
from .cli import OptionError, error, int_at_least, size
from .console import available_memory, machine, progress, tail, versions

BACKEND = "gloo"
CONSOLIDATED_LEAVES = 200
#: the options' defaults (sizes as text or bytes, counts as ints)
DEFAULTS: dict[str, Any] = dict(
    leaves=2000,
    leaf_bytes="8KiB",
    consolidated_mib=256,
    bucket_bytes="1MiB",
    iters=5,
    warmup=1,
    rounds=1,
)
QUICK: dict[str, Any] = dict(
    leaves=64,
    leaf_bytes="1KiB",
    consolidated_mib=1,
    bucket_bytes="16KiB",
    iters=2,
    warmup=1,
    rounds=1,
)
NOTE = "time = median of the receiver's timed transfers; GB/s = bytes / time / 1e9"
COLUMNS = report.COLUMNS  # its check column: ok, WRONG (wrong values) or FAIL (a rank failed)


def plan(args: argparse.Namespace) -> list[tuple[str, dict, str | None]]:
    """The (case name, case dict, stock_mode) to run, in order; raises OptionError on bad options.

    Each option's own range is checked by its argparse ``type`` (:func:`register`).
    """
    base = QUICK if args.quick else DEFAULTS
    pick = {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in DEFAULTS}
    leaf_bytes = tb.parse_size(pick["leaf_bytes"])
    if leaf_bytes % 4:
        raise OptionError(
            f"must be a multiple of 4 bytes (float32 leaves), got {leaf_bytes}", "--leaf-bytes"
        )
    bucket = tb.format_size(tb.parse_size(pick["bucket_bytes"]))
    timing = dict(iters=pick["iters"], warmup=pick["warmup"])
    out = []
    name = f"{pick['leaves']} x {tb.format_size(leaf_bytes)}"
    for impl, mode, stock_mode in tb.leaf_modes(bucket):
        out.append(
            (
                name,
                dict(leaves=pick["leaves"], leaf_bytes=leaf_bytes, impl=impl, mode=mode, **timing),
                stock_mode,
            )
        )
    mib = pick["consolidated_mib"]
    if mib:
        total = mib << 20
        name = f"consolidated {mib}MiB"
        for impl, mode, stock_mode in tb.consolidated_modes(bucket):
            out.append(
                (
                    name,
                    dict(
                        leaves=min(CONSOLIDATED_LEAVES, total // 4),
                        total_bytes=total,
                        impl=impl,
                        mode=mode,
                        **timing,
                    ),
                    stock_mode,
                )
            )
    for _, case, _ in out:
        try:
            tb.check_case(case)
        except (
            ValueError
        ) as exc:  # the options above keep every case well formed; never a traceback
            raise OptionError(str(exc)) from None
    _check_memory(out)
    return out


def _check_memory(todo: list[tuple[str, dict, str | None]]) -> None:
    """Refuse sizes whose buffers would not fit: each rank holds the tensordict, its
    consolidated copies (private and shared memory, many-leaves case only), a flat buffer and the check
    pattern."""
    need = max(tb.payload_bytes(c) * (5 if "leaf_bytes" in c else 3) * 2 for _, c, _ in todo)
    available = available_memory()
    if available is not None and need > 0.8 * available:
        raise OptionError(
            f"these sizes need about {need / 1e9:.1f} GB of memory on the two ranks, but "
            f"{available / 1e9:.1f} GB is available: lower --leaves, --leaf-bytes or --consolidated-mib"
        )


# --------------------------------------------------------------------------- table


def format_table(rows: list[report.Row], failed: set[int], header: list[str]) -> str:
    """The report's table (same cells, via :func:`cudarecv.tools.report.row_cells`); the check of a row
    whose ranks failed (``id(row)`` in ``failed``) reads FAIL."""

    def cells(r: report.Row) -> dict[str, str]:
        cell = report.row_cells(r)
        if r.seconds <= 0:  # never completed
            cell.update({"time": "-", "GB/s": "-"})
        if id(r) in failed:
            cell["check"] = "FAIL"
        return cell

    sections: dict[str | None, list[dict[str, str]]] = {
        case: [cells(r) for r in group] for case, group in report.group_cases(rows).items()
    }
    return table.text(COLUMNS, sections, left=report.LEFT, notes=header)


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand."""
    p = subparsers.add_parser(
        "compare",
        help="time stock tensordict vs cudarecv vs raw torch.distributed transfers on 2 local ranks",
    )
    d, q = DEFAULTS, QUICK
    p.add_argument(
        "--leaves",
        type=int_at_least(1),
        metavar="N",
        help=f"leaves of the many-leaves tensordict (default {d['leaves']}; --quick {q['leaves']})",
    )
    p.add_argument(
        "--leaf-bytes",
        type=size,
        metavar="SIZE",
        help=f"bytes per leaf, e.g. 8KiB or 8192 (default {d['leaf_bytes']}; --quick {q['leaf_bytes']})",
    )
    p.add_argument(
        "--consolidated-mib",
        type=int_at_least(0),
        metavar="MIB",
        help=f"MiB of the consolidated tensordict, 0 skips it (default {d['consolidated_mib']}; "
        f"--quick {q['consolidated_mib']})",
    )
    p.add_argument(
        "--bucket-bytes",
        type=size,
        metavar="SIZE",
        help=f"fast-wire message size for buckets and chunks (default {d['bucket_bytes']}; "
        f"--quick {q['bucket_bytes']})",
    )
    p.add_argument(
        "--iters",
        type=int_at_least(1),
        metavar="N",
        help=f"timed transfers per mode and round (default {d['iters']}; --quick {q['iters']})",
    )
    p.add_argument(
        "--warmup",
        type=int_at_least(0),
        metavar="N",
        help=f"untimed transfers first (default {d['warmup']})",
    )
    p.add_argument(
        "--rounds",
        type=int_at_least(1),
        metavar="N",
        help=f"repeat all modes N times, alternating them (default {d['rounds']})",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes, for a smoke test (a few seconds)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run every mode, print progress then the table; 0 if all checks pass."""
    try:
        todo = plan(args)
    except OptionError as exc:
        error("compare", str(exc))
        return 2
    rounds = args.rounds or (QUICK if args.quick else DEFAULTS)["rounds"]
    keys = list(dict.fromkeys((name, case["impl"], case["mode"]) for name, case, _ in todo))
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    errors: dict[tuple, list[str]] = {k: [] for k in keys}
    transports: dict[
        tuple, str
    ] = {}  # what carried each mode's payload (cudarecv: shared memory on one machine)
    crashed: set[tuple] = set()  # modes whose ranks failed (else an error is a wrong value)
    total, done = rounds * len(todo), 0
    progress(
        f"cudarecv compare: {len(todo)} modes x {rounds} round(s) on 2 local ranks ({BACKEND}), "
        f"{todo[0][1]['iters']} timed + {todo[0][1]['warmup']} warm-up transfers each"
    )
    t_start = time.perf_counter()
    cluster = None
    try:
        for _ in range(rounds):
            for name, case, _ in todo:
                key = (name, case["impl"], case["mode"])
                if cluster is None:
                    try:
                        cluster = Cluster(2)
                    except RankError as exc:
                        error("compare", f"cannot start the 2 local ranks: {exc}")
                        return 1
                try:
                    result = tb.summarize(
                        case, cluster.run(tb.time_case, args=(case,), timeout=600)
                    )
                except RankError as exc:
                    cluster = None  # closed by the failure: start fresh ranks for the next mode
                    errors[key].append(str(exc))
                    crashed.add(key)
                    status = f"FAIL: {str(exc).strip().splitlines()[-1]}"
                else:
                    times[key] += result["seconds_all"]
                    transports[key] = result["transport"] if case["impl"] == "cudarecv" else "wire"
                    if not result["ok"]:
                        errors[key].append(result["error"])
                    seconds = result["seconds"]
                    status = (
                        f"{report.format_time(seconds):>10}  {result['bytes'] / seconds / 1e9:7.2f} GB/s  "
                        + ("ok" if result["ok"] else f"WRONG: {result['error']}")
                    )
                done += 1
                progress(
                    f"[{done:>{len(str(total))}}/{total}] {name:<22} {case['impl']:<8} {case['mode']:<22} "
                    f"{status}"
                )
    except KeyboardInterrupt:
        error("compare", "interrupted")
        return 130
    finally:
        if cluster is not None:
            cluster.close()

    rows, crashed_rows = [], set()
    stock_modes = {(name, c["impl"], c["mode"]): sm for name, c, sm in todo}
    cases = {(name, c["impl"], c["mode"]): c for name, c, _ in todo}
    for key in keys:
        name, impl, mode = key
        case, ts = cases[key], sorted(times[key])
        row = report.Row(
            name=f"{name} {impl} {mode}",
            seconds=tb.median(ts) if ts else 0.0,
            case=name,
            impl=impl,
            mode=mode,
            nbytes=tb.payload_bytes(case),
            leaves=case["leaves"],
            stock_mode=stock_modes[key],
            backend=BACKEND,
            ok=not errors[key],
            transport=transports.get(key),
        )
        rows.append(row)
        if key in crashed:
            crashed_rows.add(id(row))
    report.compute_ratios(rows)
    it = todo[0][1]
    header = [
        report.header_line(machine()),
        f"{versions()}; 2 local ranks, {BACKEND} loopback; {it['iters'] * rounds} "
        f"timed transfers per mode ({rounds} round(s) x {it['iters']}, after {it['warmup']} warm-up)",
        NOTE,
        report.RATIO_NOTE,
        "check = values verified on the receiver after the timed transfers: ok, WRONG, or FAIL (a rank failed)",
    ]
    sys.stdout.write(format_table(rows, crashed_rows, header))
    failed = [k for k in keys if errors[k]]
    if failed:
        sys.stdout.write(
            f"# checks: {len(failed)} of {len(keys)} modes FAILED (WRONG values or a rank failed)\n"
        )
        sys.stdout.flush()
        for name, impl, mode in failed:
            for problem in dict.fromkeys(errors[(name, impl, mode)]):
                error("compare", f"{name}: {impl} {mode}: {tail(problem)}")
        return 1
    sys.stdout.write(
        f"# checks: all {len(keys)} modes delivered the right values "
        f"({time.perf_counter() - t_start:.1f} s)\n"
    )
    sys.stdout.flush()
    return 0
