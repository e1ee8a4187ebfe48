"""TensorDict transfers on gloo loopback: stock tensordict vs cudarecv vs raw torch.distributed.

Run with ``pytest bench/ -p no:cacheprovider --benchmark-json BENCH.json``, then
``python -m cudarecv report BENCH.json``.

Each benchmark here times the mode it names: its pytest-benchmark rounds are
the receiver's own per-iteration times of that mode (rank 1 times each transfer
from just before its receive call until the data has landed, after a barrier
that starts both ends together; see :mod:`cudarecv.tools.transfer_ranks`),
handed to pytest-benchmark through a virtual clock (``tb.VirtualClock``,
``tb.replay``). So the table pytest-benchmark prints, its JSON ``stats`` and
``--benchmark-compare`` are those times, and ``python -m cudarecv report``
reads ``stats.median``. ``extra_info`` carries ``case``, ``impl``, ``mode``,
``bytes``, ``leaves``, ``backend`` ("gloo"), ``stock_mode`` where the stock
reference has another mode, ``ok`` (the values checked after the timed loop
were right; a wrong transfer also fails its bench), ``send_seconds`` (the
sender's median), ``cpu_seconds``/``send_cpu_seconds`` (the median CPU time of
the receiving/sending process per transfer, every thread), ``suite_rounds``,
``iters`` and ``suite_seconds`` (the parent's wall time of the whole case).

Design, to beat the noise of a shared 2-core machine: the impls of a case are
measured side by side in one call into the ranks (:func:`time_suite`). Every
mode first runs its warm-up iterations; then ``suite_rounds`` rounds each run
``iters`` timed iterations of every mode, the order rotated by one mode per
round (so each bench has ``suite_rounds * iters`` pytest-benchmark rounds). A
burst of load thus hits all modes of a case alike instead of one bench, and
ratios within a case compare times taken seconds apart. The first bench of a
case runs the whole case; the others replay its results.

Cases (all float32 leaves, a tenth of them nested):

- ``2000 x 8KiB``: many small leaves, every mode; targets, against stock's
  fastest mode for this data (``consolidated``, not per leaf): cudarecv
  ``buckets 1MiB`` and ``chunks 1MiB`` (through shared memory: both ranks are
  cudarecv on this machine) >= 2x (the bound is two memcpys of 16 MB),
  ``buckets 1MiB wire`` and ``chunks 1MiB wire`` (``transport="wire"``: the gloo
  socket) >= 1x; raw ``buckets 1MiB`` (hand-rolled: cat, N-byte isend/irecv,
  copy out) is that wire's floor;
- ``2000 x 8KiB fast wire``: ``bucket_bytes`` 256KiB/1MiB/4MiB, buckets and chunks;
- ``consolidated 256MiB``: 200 leaves in one consolidated tensordict on both
  sides; targets: cudarecv ``consolidated`` >= 0.95x raw ``flat recv``,
  ``chunks 1MiB`` (shared memory segments: a copy on each side) and ``chunks 1MiB shared``
  (the sender's storage in shared memory, ``consolidate(share_memory=True)``: the receiver's
  one copy straight out of it) >= 2.5x, ``chunks 1MiB wire`` >= 1.3x raw ``flat recv``;
- ``consolidated 1MiB`` .. ``64MiB``: a size sweep for the report's plot.

The measured target ratios are printed at the end of the pytest run.
"""

from __future__ import annotations

from typing import Any

import pytest

from cudarecv.tools import transfer_ranks as tb

# every bench here reports times measured in the ranks, replayed through this clock (tb.replay)
CLOCK = tb.VirtualClock("receiver_clock")
pytestmark = [pytest.mark.timeout(600), pytest.mark.benchmark(timer=CLOCK)]

MiB = 1 << 20
BACKEND = "gloo"

# name -> workload, rounds, iters, warmup, [(impl, mode, stock_mode)]; "vs raw" is the first raw row
SUITES: dict[str, dict[str, Any]] = {
    "2000 x 8KiB": dict(
        workload=dict(leaves=2000, leaf_bytes=8192),
        rounds=20,
        iters=3,
        warmup=2,
        modes=tb.leaf_modes("1MiB"),
    ),
    "2000 x 8KiB fast wire": dict(
        workload=dict(leaves=2000, leaf_bytes=8192),
        rounds=15,
        iters=3,
        warmup=2,
        modes=[
            ("stock", "per-leaf", None),
            ("stock", "consolidated", None),
            ("raw", "flat recv", None),
            *[("cudarecv", f"buckets {s}", "per-leaf") for s in ("256KiB", "1MiB", "4MiB")],
            *[("cudarecv", f"chunks {s}", "consolidated") for s in ("256KiB", "1MiB", "4MiB")],
            ("cudarecv", "buckets 1MiB wire", "per-leaf"),
            ("cudarecv", "chunks 1MiB wire", "consolidated"),
        ],
    ),
    "consolidated 256MiB": dict(
        workload=dict(leaves=200, total_bytes=256 * MiB),
        rounds=10,
        iters=2,
        warmup=1,
        modes=tb.consolidated_modes("1MiB"),
    ),
    **{
        f"consolidated {mib}MiB": dict(
            workload=dict(leaves=200, total_bytes=mib * MiB),
            rounds=12,
            iters=3,
            warmup=2,
            modes=[
                ("stock", "consolidated", None),
                ("raw", "flat recv", "consolidated"),
                ("cudarecv", "consolidated", None),
                ("cudarecv", "chunks 1MiB", "consolidated"),
            ],
        )
        for mib in (1, 4, 16, 64)
    },
}

# (label, case, (impl, mode), reference (impl, mode), target ratio = reference time / row time)
TARGETS = [
    (
        "cudarecv per-leaf vs stock per-leaf",
        "2000 x 8KiB",
        ("cudarecv", "per-leaf"),
        ("stock", "per-leaf"),
        None,
    ),
    (
        "buckets 1MiB (shared memory) vs stock consolidated (its best)",
        "2000 x 8KiB",
        ("cudarecv", "buckets 1MiB"),
        ("stock", "consolidated"),
        2.0,
    ),
    (
        "chunks 1MiB (shared memory) vs stock consolidated (its best)",
        "2000 x 8KiB",
        ("cudarecv", "chunks 1MiB"),
        ("stock", "consolidated"),
        2.0,
    ),
    (
        "buckets 1MiB wire vs stock consolidated (its best)",
        "2000 x 8KiB",
        ("cudarecv", "buckets 1MiB wire"),
        ("stock", "consolidated"),
        1.0,
    ),
    (
        "chunks 1MiB wire vs stock consolidated (its best)",
        "2000 x 8KiB",
        ("cudarecv", "chunks 1MiB wire"),
        ("stock", "consolidated"),
        1.0,
    ),
    (
        "buckets 1MiB wire vs raw hand-rolled buckets 1MiB",
        "2000 x 8KiB",
        ("cudarecv", "buckets 1MiB wire"),
        ("raw", "buckets 1MiB"),
        None,
    ),
    (
        "buckets 1MiB (shared memory) vs buckets 1MiB wire",
        "2000 x 8KiB",
        ("cudarecv", "buckets 1MiB"),
        ("cudarecv", "buckets 1MiB wire"),
        None,
    ),
    (
        "consolidated vs raw flat recv",
        "consolidated 256MiB",
        ("cudarecv", "consolidated"),
        ("raw", "flat recv"),
        0.95,
    ),
    (
        "chunks 1MiB (shared memory) vs raw flat recv",
        "consolidated 256MiB",
        ("cudarecv", "chunks 1MiB"),
        ("raw", "flat recv"),
        2.5,
    ),
    (
        "chunks 1MiB shared (storage in shared memory) vs raw flat recv",
        "consolidated 256MiB",
        ("cudarecv", "chunks 1MiB shared"),
        ("raw", "flat recv"),
        2.5,
    ),
    (
        "chunks 1MiB wire vs raw flat recv",
        "consolidated 256MiB",
        ("cudarecv", "chunks 1MiB wire"),
        ("raw", "flat recv"),
        1.3,
    ),
]
# CPU seconds per transfer of both processes (all threads), where the 2 cores are the limit
CPU_COST = [
    (
        "2000 x 8KiB",
        [
            ("cudarecv", "buckets 1MiB"),
            ("cudarecv", "buckets 1MiB wire"),
            ("raw", "buckets 1MiB"),
            ("cudarecv", "chunks 1MiB"),
            ("stock", "per-leaf"),
        ],
    )
]
# pseudo_rand cost: time with pseudo_rand / time without (1.0 = free)
PSEUDO_RAND_COST = [("stock", "2000 x 8KiB"), ("cudarecv", "2000 x 8KiB")]

_results: dict[str, dict[tuple[str, str], dict]] = {}
_errors: dict[str, str] = {}


def _suite_cases(name: str) -> list[dict]:
    suite = SUITES[name]
    cases = []
    for impl, mode, _ in suite["modes"]:
        case = dict(
            suite["workload"], impl=impl, mode=mode, iters=suite["iters"], warmup=suite["warmup"]
        )
        tb.check_case(case)
        cases.append(case)
    return cases


def _run_suite(holder: Any, name: str, targets: list[str]) -> dict[tuple[str, str], dict]:
    """The results of case ``name``: run all its modes interleaved, once per session."""
    return tb.run_suite_once(
        holder,
        name,
        targets,
        rank_fn=tb.time_suite,
        cases=_suite_cases,
        rounds=SUITES[name]["rounds"],
        row_mode=lambda case: case["mode"],
        target_lines=_target_lines,
        results=_results,
        errors=_errors,
    )


def _target_lines(name: str, rows: dict[tuple[str, str], dict]) -> list[str]:
    lines = []
    for label, case, mine, ref, target in TARGETS:
        if case == name and mine in rows and ref in rows:
            ratio = rows[ref]["seconds"] / rows[mine]["seconds"]
            verdict = (
                ""
                if target is None
                else f"  (target >= {target:g}x: {'met' if ratio >= target else 'MISSED'})"
            )
            lines.append(f"{case}: {label}: {ratio:.2f}x{verdict}")
    for case, modes in CPU_COST:
        if case == name:
            cost = [
                f"{impl} {mode} {rows[(impl, mode)]['send_cpu_seconds'] * 1e3:.1f} + "
                f"{rows[(impl, mode)]['cpu_seconds'] * 1e3:.1f} ms"
                for impl, mode in modes
                if (impl, mode) in rows
            ]
            lines.append(f"{case}: CPU per transfer, sender + receiver process: " + "; ".join(cost))
    for impl, case in PSEUDO_RAND_COST:
        plain, rand = rows.get((impl, "per-leaf")), rows.get((impl, "per-leaf pseudo_rand"))
        if case == name and plain and rand:
            lines.append(
                f"{case}: {impl} pseudo_rand cost: {rand['seconds'] / plain['seconds']:.2f}x "
                f"the time of per-leaf ({rand['seconds'] * 1e3:.2f} ms vs {plain['seconds'] * 1e3:.2f} ms)"
            )
    return lines


def _bench(
    benchmark: Any,
    holder: Any,
    targets: list[str],
    name: str,
    impl: str,
    mode: str,
    stock_mode: str | None,
) -> None:
    row = _run_suite(holder, name, targets)[(impl, mode)]
    info = {
        "case": name,
        "impl": impl,
        "mode": mode,
        "bytes": row["bytes"],
        "leaves": row["leaves"],
        "backend": BACKEND,
        "send_seconds": row["send_seconds"],
        "cpu_seconds": row["cpu_seconds"],
        "send_cpu_seconds": row["send_cpu_seconds"],
        "suite_rounds": SUITES[name]["rounds"],
        "iters": SUITES[name]["iters"],
        "suite_seconds": row["suite_seconds"],
        "ok": row["ok"],
        "transport": row["transport"] if impl == "cudarecv" else "wire",
    }
    if stock_mode is not None:
        info["stock_mode"] = stock_mode
    benchmark.extra_info.update(info)
    tb.replay(benchmark, CLOCK, row["seconds_all"])  # the stats: every timed iteration of this mode
    assert row["ok"], f"{name}: {impl} {mode} delivered wrong data: {row['error']}"


def _params(*names: str) -> list[Any]:
    return [
        pytest.param(
            name,
            impl,
            mode,
            stock_mode,
            id=f"{name}-{impl}-{mode}".replace(" x ", "x").replace(" ", "_"),
        )
        for name in names
        for impl, mode, stock_mode in SUITES[name]["modes"]
    ]


ARGS = "name,impl,mode,stock_mode"


@pytest.mark.parametrize(ARGS, _params("2000 x 8KiB"))
def test_many_small_leaves(
    benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode
):
    _bench(benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode)


@pytest.mark.parametrize(ARGS, _params("2000 x 8KiB fast wire"))
def test_fast_wire_bucket_bytes(
    benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode
):
    _bench(benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode)


@pytest.mark.parametrize(ARGS, _params("consolidated 256MiB"))
def test_consolidated_256mib(
    benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode
):
    _bench(benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode)


SWEEP = [n for n in SUITES if n.startswith("consolidated") and n != "consolidated 256MiB"]


@pytest.mark.parametrize(ARGS, _params(*SWEEP))
def test_consolidated_size_sweep(
    benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode
):
    _bench(benchmark, transfer_cluster, transfer_targets, name, impl, mode, stock_mode)
