"""GPU benchmarks: staging through CUDA and pinned memory, stream overlap, NCCL batching, the tag kernel.

Run on a GPU machine (skipped without ``--gpus``, and without CUDA)::

    pytest bench/bench_gpu.py --gpus 1 -p no:cacheprovider --benchmark-json GPU.json
    python -m cudarecv report GPU.json

The NCCL benches are marked ``gpus(1)``: their ranks come from
:func:`cudarecv.testing.gpu.nccl_ranks`, one GPU per rank where there are enough, else
sharing GPU 0 (``NCCL_MULTI_RANK_GPU_ENABLE=1`` with NCCL >= 2.30; with an older NCCL each
rank its own ``NCCL_HOSTID``, so NCCL's socket transport over loopback carries the bytes:
then their times are the socket path's, not the GPU's, and the rows say so in
``extra_info["nccl_mode"]``). ``test_matmul_during_nccl_receive`` needs two real GPUs.

As in ``bench/bench_transfers.py``, each bench times the mode it names: its
pytest-benchmark rounds are that mode's per-iteration times as the receiver
measured them inside the ranks (a GPU receive until its bytes landed; the tag
kernel's GPU time per launch, CUDA events), replayed through a virtual clock
(``tb.VirtualClock``, ``tb.replay``), so ``stats.median`` is what ``python -m
cudarecv report`` shows. Rows carry the ``extra_info`` of the CPU benches
(``case``, ``impl``, ``mode``, ``bytes``, ``leaves``, ``backend``, ``stock_mode``,
``ok``), plus ``send_place``/``recv_place``. Modes read ``"<mode> <send place>-><receive
place>"``, e.g. ``chunks 4MiB cpu->cuda``. The modes of a case run side by side
in one call into the ranks, in rotated rounds (:mod:`cudarecv.tools.gpu_ranks`), and
each is checked once after its timed rounds. Targets, printed at the end with
their ratio and met/MISSED:

- ``gloo 256MiB``: gloo into CUDA storage with ``bucket_bytes=4MiB`` >= 0.9x the
  same receive into pinned storage (no device copy);
- ``matmul + 1GiB receive (gloo)``: a bf16 matmul loop on the receiver's default
  stream slows <= 5% while a 1 GiB consolidated receive lands on the dedicated
  stream (and, with two real GPUs, the same over NCCL);
- ``tag map``: the cupy kernel computes all 10001 entries in < 100 us;
- ``nccl consolidated 256MiB``: cudarecv consolidated >= 0.9x raw ``dist.recv``
  of one flat buffer;
- ``nccl 2000 x 8KiB``: cudarecv per-leaf (one batched NCCL group call) >= 5x
  raw per-leaf ``dist.irecv``.

Without pytest-benchmark installed, a minimal ``benchmark`` fixture here runs
the same benches (timed by the same virtual clock) and, if ``CUDARECV_BENCH_JSON``
names a file, writes the rows there in pytest-benchmark's JSON layout (what
``python -m cudarecv report`` reads).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from cudarecv.testing.gpu import NcclRanks, nccl_ranks_problem
from cudarecv.testing.gpu import nccl_ranks as start_nccl_ranks
from cudarecv.testing.launch import RankError, Ranks
from cudarecv.tools import gpu_ranks as gb
from cudarecv.tools import transfer_ranks as tb

HAS_CUDA = torch.cuda.is_available()

# every bench here reports times measured elsewhere (ranks, CUDA events), replayed through this clock
CLOCK = tb.VirtualClock("receiver_clock")
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.benchmark(timer=CLOCK),
    pytest.mark.gpus(1),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]
nccl_mark = pytest.mark.gpus(1)  # nccl_ranks shares one GPU where there are fewer than ranks

MiB, GiB = 1 << 20, 1 << 30

# --------------------------------------------------------------------------- without pytest-benchmark

try:
    import pytest_benchmark  # noqa: F401

    HAVE_PYTEST_BENCHMARK = True
except ImportError:
    HAVE_PYTEST_BENCHMARK = False

_FALLBACK_ROWS: list[dict] = []


class _FallbackBenchmark:
    """The part of pytest-benchmark's fixture these benches use: ``pedantic`` and ``extra_info``.

    As pytest-benchmark's, it reads its timer (the ``benchmark(timer=...)`` marker's, else
    ``time.perf_counter``) only just before and just after each round's calls of the target.
    """

    def __init__(self, name: str, timer: Any = time.perf_counter) -> None:
        self.name = name
        self.extra_info: dict[str, Any] = {}
        self.times: list[float] = []
        self._timer = timer

    def pedantic(
        self,
        target,
        args=(),
        kwargs=None,
        setup=None,
        teardown=None,
        rounds=1,
        warmup_rounds=0,
        iterations=1,
    ):
        result = None
        for _ in range(warmup_rounds):
            target(*args, **(kwargs or {}))
        for _ in range(rounds):
            if setup is not None:
                setup()
            t0 = self._timer()
            for _ in range(iterations):
                result = target(*args, **(kwargs or {}))
            self.times.append((self._timer() - t0) / iterations)
            if teardown is not None:
                teardown()
        return result


def _write_fallback_json() -> None:
    path = os.environ.get("CUDARECV_BENCH_JSON")
    if not path:
        return
    data = {
        "machine_info": {
            "node": platform.node(),
            "system": platform.system(),
            "machine": platform.machine(),
            "python_version": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if HAS_CUDA else None,
        },
        "datetime": datetime.now(timezone.utc).isoformat(),
        "version": None,
        "benchmarks": _FALLBACK_ROWS,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)


if not HAVE_PYTEST_BENCHMARK:

    @pytest.fixture
    def benchmark(request):
        """Stand-in for pytest-benchmark's fixture (not installed); rows go to $CUDARECV_BENCH_JSON."""
        marker = request.node.get_closest_marker("benchmark")
        bench = _FallbackBenchmark(
            request.node.name, (marker.kwargs if marker else {}).get("timer", time.perf_counter)
        )
        yield bench
        if bench.times:
            times = sorted(bench.times)
            _FALLBACK_ROWS.append(
                {
                    "name": request.node.name,
                    "fullname": request.node.nodeid,
                    "extra_info": bench.extra_info,
                    "stats": {
                        "median": statistics.median(times),
                        "min": times[0],
                        "max": times[-1],
                        "mean": statistics.mean(times),
                        "rounds": len(times),
                        "data": list(bench.times),
                    },
                }
            )
            _write_fallback_json()


# --------------------------------------------------------------------------- ranks


def nccl_skip_reason(world: int = 2) -> str | None:
    """Why ``world`` NCCL ranks cannot run here, or None."""
    return nccl_ranks_problem(world)


@pytest.fixture(scope="module")
def gloo_ranks():
    ranks = Ranks(2, pg_timeout=120.0)
    yield ranks
    ranks.close()


def _nccl(world: int):
    """``world`` NCCL ranks for a module (skipped, saying why, where NCCL ranks cannot run)."""
    reason = nccl_skip_reason(world)
    if reason:
        pytest.skip(reason)
    ranks = start_nccl_ranks(world, pg_timeout=120.0)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def nccl_ranks():
    yield from _nccl(2)


# --------------------------------------------------------------------------- transfer suites

# name -> backend, workload, rounds, iters, warmup, [(impl, mode, send place, recv place, stock row's mode)]
SUITES: dict[str, dict[str, Any]] = {
    "gloo 256MiB": dict(
        backend="gloo",
        workload=dict(leaves=200, total_bytes=256 * MiB),
        rounds=5,
        iters=2,
        warmup=1,
        modes=[
            ("raw", "flat recv", "cpu", "pinned", None),
            ("stock", "consolidated", "cpu", "pinned", None),
            ("cudarecv", "consolidated", "cpu", "pinned", "consolidated cpu->pinned"),
            ("cudarecv", "chunks 4MiB", "cpu", "pinned", "consolidated cpu->pinned"),
            ("cudarecv", "consolidated", "cpu", "cuda", "consolidated cpu->pinned"),
            ("cudarecv", "chunks 4MiB", "cpu", "cuda", "consolidated cpu->pinned"),
            ("cudarecv", "chunks 1MiB", "cpu", "cuda", "consolidated cpu->pinned"),
            (
                "cudarecv",
                "chunks 4MiB",
                "cuda",
                "cuda",
                "consolidated cpu->pinned",
            ),  # CUDA IPC (same host)
            (
                "cudarecv",
                "chunks 4MiB wire",
                "cuda",
                "cuda",
                "consolidated cpu->pinned",
            ),  # staged on the socket
        ],
    ),
    "gloo 2000 x 8KiB": dict(
        backend="gloo",
        workload=dict(leaves=2000, leaf_bytes=8192),
        rounds=5,
        iters=3,
        warmup=2,
        modes=[
            ("raw", "flat recv", "cpu", "pinned", None),
            ("stock", "per-leaf", "cpu", "cpu", None),
            ("stock", "consolidated", "cpu", "cpu", None),  # stock's best for this data
            ("cudarecv", "per-leaf", "cpu", "cuda", "per-leaf cpu->cpu"),
            ("cudarecv", "buckets 1MiB", "cpu", "cuda", "per-leaf cpu->cpu"),
            ("cudarecv", "buckets 1MiB", "cuda", "cuda", "per-leaf cpu->cpu"),
            ("cudarecv", "chunks 1MiB", "cpu", "cuda", "per-leaf cpu->cpu"),
        ],
    ),
    "nccl consolidated 256MiB": dict(
        backend="nccl",
        workload=dict(leaves=200, total_bytes=256 * MiB),
        rounds=5,
        iters=3,
        warmup=2,
        modes=[
            ("raw", "flat recv", "cuda", "cuda", None),
            ("stock", "consolidated", "cuda", "cuda", None),
            ("cudarecv", "consolidated", "cuda", "cuda", "consolidated cuda->cuda"),
            ("cudarecv", "chunks 4MiB", "cuda", "cuda", "consolidated cuda->cuda"),
            ("cudarecv", "consolidated", "cuda", "pinned", "consolidated cuda->cuda"),
            ("cudarecv", "chunks 4MiB", "cuda", "pinned", "consolidated cuda->cuda"),
            ("cudarecv", "consolidated", "pinned", "cuda", "consolidated cuda->cuda"),
        ],
    ),
    "nccl 2000 x 8KiB": dict(
        backend="nccl",
        workload=dict(leaves=2000, leaf_bytes=8192),
        rounds=5,
        iters=3,
        warmup=2,
        modes=[
            ("raw", "flat recv", "cuda", "cuda", None),
            ("raw", "per-leaf dist.irecv", "cuda", "cuda", "per-leaf cuda->cuda"),
            ("stock", "per-leaf", "cuda", "cuda", None),
            ("stock", "consolidated", "cuda", "cuda", None),  # stock's best for this data
            ("cudarecv", "per-leaf", "cuda", "cuda", "per-leaf cuda->cuda"),
            ("cudarecv", "buckets 1MiB", "cuda", "cuda", "per-leaf cuda->cuda"),
            ("cudarecv", "consolidated", "cuda", "cuda", "per-leaf cuda->cuda"),
            ("cudarecv", "chunks 1MiB", "cuda", "cuda", "per-leaf cuda->cuda"),
        ],
    ),
}

# (label, case, (impl, row mode), reference (impl, row mode), target: reference time / row time >= target)
TARGETS = [
    (
        "gloo into CUDA, chunks 4MiB, vs into pinned, chunks 4MiB",
        "gloo 256MiB",
        ("cudarecv", "chunks 4MiB cpu->cuda"),
        ("cudarecv", "chunks 4MiB cpu->pinned"),
        0.9,
    ),
    (
        "gloo into CUDA, chunks 4MiB, vs into pinned, one message",
        "gloo 256MiB",
        ("cudarecv", "chunks 4MiB cpu->cuda"),
        ("cudarecv", "consolidated cpu->pinned"),
        None,
    ),
    (
        "gloo into CUDA, one message, vs into pinned, one message",
        "gloo 256MiB",
        ("cudarecv", "consolidated cpu->cuda"),
        ("cudarecv", "consolidated cpu->pinned"),
        None,
    ),
    (
        "gloo into CUDA, chunks 1MiB, vs stock consolidated into host memory (its best)",
        "gloo 2000 x 8KiB",
        ("cudarecv", "chunks 1MiB cpu->cuda"),
        ("stock", "consolidated cpu->cpu"),
        None,
    ),
    (
        "nccl consolidated vs raw flat dist.recv",
        "nccl consolidated 256MiB",
        ("cudarecv", "consolidated cuda->cuda"),
        ("raw", "flat recv cuda->cuda"),
        0.9,
    ),
    (
        "nccl chunks 4MiB vs raw flat dist.recv",
        "nccl consolidated 256MiB",
        ("cudarecv", "chunks 4MiB cuda->cuda"),
        ("raw", "flat recv cuda->cuda"),
        None,
    ),
    (
        "nccl per-leaf (batched) vs raw per-leaf dist.irecv",
        "nccl 2000 x 8KiB",
        ("cudarecv", "per-leaf cuda->cuda"),
        ("raw", "per-leaf dist.irecv cuda->cuda"),
        5.0,
    ),
    (
        "nccl per-leaf (batched) vs stock per-leaf",
        "nccl 2000 x 8KiB",
        ("cudarecv", "per-leaf cuda->cuda"),
        ("stock", "per-leaf cuda->cuda"),
        None,
    ),
    (
        "nccl chunks 1MiB vs stock consolidated (its best)",
        "nccl 2000 x 8KiB",
        ("cudarecv", "chunks 1MiB cuda->cuda"),
        ("stock", "consolidated cuda->cuda"),
        None,
    ),
]

_results: dict[str, dict[tuple[str, str], dict]] = {}
_errors: dict[str, str] = {}


def _suite_cases(name: str) -> list[dict]:
    suite = SUITES[name]
    cases = []
    for impl, mode, send_place, recv_place, _ in suite["modes"]:
        case = dict(
            suite["workload"],
            impl=impl,
            mode=mode,
            send_place=send_place,
            recv_place=recv_place,
            iters=suite["iters"],
            warmup=suite["warmup"],
        )
        gb.check_gpu_case(case, suite["backend"])
        cases.append(case)
    return cases


def _verdict(ratio: float, target: float | None, at_least: bool = True) -> str:
    if target is None:
        return ""
    met = ratio >= target if at_least else ratio <= target
    return f"  (target {'>=' if at_least else '<='} {target:g}x: {'met' if met else 'MISSED'})"


def _target_lines(name: str, rows: dict[tuple[str, str], dict]) -> list[str]:
    lines = []
    for text, case, mine, ref, target in TARGETS:
        if case == name and mine in rows and ref in rows:
            ratio = rows[ref]["seconds"] / rows[mine]["seconds"]
            lines.append(
                f"{case}: {text}: {ratio:.2f}x ({rows[mine]['seconds'] * 1e3:.2f} ms vs "
                f"{rows[ref]['seconds'] * 1e3:.2f} ms){_verdict(ratio, target)}"
            )
    return lines


def _run_suite(ranks: Ranks, name: str, targets: list[str]) -> dict[tuple[str, str], dict]:
    """The rows of suite ``name``, keyed by (impl, row mode): all its modes run once per session."""
    return tb.run_suite_once(
        ranks,
        name,
        targets,
        rank_fn=gb.time_gpu_suite,
        cases=_suite_cases,
        rounds=SUITES[name]["rounds"],
        row_mode=gb.label,
        target_lines=_target_lines,
        results=_results,
        errors=_errors,
        what="suite",
    )


def _bench(
    benchmark,
    ranks: Ranks,
    targets: list[str],
    name: str,
    impl: str,
    mode: str,
    send_place: str,
    recv_place: str,
    stock_mode: str | None,
) -> None:
    rows = _run_suite(ranks, name, targets)
    case = dict(mode=mode, send_place=send_place, recv_place=recv_place)
    row = rows[(impl, gb.label(case))]
    info = {
        "case": name,
        "impl": impl,
        "mode": gb.label(case),
        "bytes": row["bytes"],
        "leaves": row["leaves"],
        "backend": SUITES[name]["backend"],
        "send_seconds": row["send_seconds"],
        "suite_rounds": SUITES[name]["rounds"],
        "iters": SUITES[name]["iters"],
        "suite_seconds": row["suite_seconds"],
        "send_place": send_place,
        "recv_place": recv_place,
        "ok": row["ok"],
        "transport": row["transport"],
    }
    if stock_mode is not None:
        info["stock_mode"] = stock_mode
    if isinstance(ranks, NcclRanks):  # per_gpu, or sharing a GPU: multi_rank, hostid (sockets)
        info["nccl_mode"] = ranks.mode
    benchmark.extra_info.update(info)
    tb.replay(benchmark, CLOCK, row["seconds_all"])  # the stats: every timed iteration of this mode
    assert row["ok"], f"{name}: {impl} {gb.label(case)} delivered wrong data: {row['error']}"
    claimed = _claimed_transport(SUITES[name]["backend"], impl, mode, send_place, recv_place)
    assert claimed in (None, row["transport"]), (
        f"{name}: {impl} {gb.label(case)} is labelled {claimed}, but {row['transport']} carried it"
    )


def _claimed_transport(
    backend: str, impl: str, mode: str, send_place: str, recv_place: str
) -> str | None:
    """What a row's label says carried it: the socket for a "wire" mode, CUDA IPC for a gloo receive of device
    memory from device memory on this host (None: the label claims nothing)."""
    if impl != "cudarecv" or backend != "gloo":
        return None
    if mode.endswith(" wire"):
        return "wire"
    return "cuda ipc" if (send_place, recv_place) == ("cuda", "cuda") else None


def _params(name: str) -> list[Any]:
    return [
        pytest.param(
            name, *mode, id=f"{name}-{mode[0]}-{mode[1]}-{mode[2]}-to-{mode[3]}".replace(" ", "_")
        )
        for mode in SUITES[name]["modes"]
    ]


ARGS = "name,impl,mode,send_place,recv_place,stock_mode"


# --------------------------------------------------------------------------- the tag kernel (in-process)

_TAGS: dict[str, list[float]] = {}
TAG_CASE = "tag map 10001 entries"
TAG_STOCK_MODE = "_int_generator loop"


def _stock_tag_map() -> list[int]:
    """The reference: stock ``_int_generator`` of every seed, 0..10000."""
    from cudarecv.p2p.stock import int_generator as _int_generator

    return [_int_generator(s) for s in range(10_001)]


def _tag_rows(
    benchmark,
    impl: str,
    mode: str,
    seconds: list[float],
    targets: list[str],
    ok: bool | None = None,
) -> None:
    benchmark.extra_info.update(
        {
            "case": TAG_CASE,
            "impl": impl,
            "mode": mode,
            "bytes": 0,
            "leaves": 10_001,
            "backend": "cuda",
            **({"stock_mode": TAG_STOCK_MODE} if impl != "stock" else {}),
            **({"ok": ok} if ok is not None else {}),
        }
    )
    tb.replay(benchmark, CLOCK, seconds)
    _TAGS[mode] = seconds
    if "cupy kernel" in _TAGS and mode == "cupy kernel":
        us = statistics.median(_TAGS["cupy kernel"]) * 1e6
        targets.append(
            f"{TAG_CASE}: cupy kernel, GPU time per launch: {us:.1f} us "
            f"(target < 100 us: {'met' if us < 100 else 'MISSED'})"
        )
    assert ok is not False, f"{TAG_CASE}: {mode} differs from stock _int_generator"


def _times(run, rounds: int) -> list[float]:
    """``perf_counter`` seconds of each of ``rounds`` calls of ``run``."""
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    return seconds


def test_tag_map_stock(benchmark, transfer_targets):
    seconds = _times(_stock_tag_map, 3)
    _tag_rows(benchmark, "stock", TAG_STOCK_MODE, seconds, transfer_targets)


def test_tag_map_numpy(benchmark, transfer_targets):
    import numpy as np

    from cudarecv.plan.tags import int_generator_many

    seeds = np.arange(10_001, dtype=np.uint64)
    seconds = _times(lambda: int_generator_many(seeds), 5)
    ok = int_generator_many(seeds).tolist() == _stock_tag_map()
    _tag_rows(benchmark, "cudarecv", "numpy twin", seconds, transfer_targets, ok)


def test_tag_map_kernel(benchmark, transfer_targets):
    from cudarecv.cuda import tag_kernel

    if not tag_kernel.gpu_available():
        pytest.skip("cupy is not installed or sees no CUDA device (pip install 'cudarecv[gpu]')")
    tag_kernel.time_tag_map_gpu(10)  # compile and load the kernel
    seconds = [
        tag_kernel.time_tag_map_gpu(100) * 1e-6 for _ in range(5)
    ]  # GPU time per launch (CUDA events)
    ok = tag_kernel.tag_map_gpu().tolist() == _stock_tag_map()
    _tag_rows(benchmark, "cudarecv", "cupy kernel", seconds, transfer_targets, ok)


# --------------------------------------------------------------------------- gloo


@pytest.mark.parametrize(ARGS, _params("gloo 256MiB"))
def test_gloo_256mib_device_vs_pinned(
    benchmark, gloo_ranks, transfer_targets, name, impl, mode, send_place, recv_place, stock_mode
):
    _bench(
        benchmark,
        gloo_ranks,
        transfer_targets,
        name,
        impl,
        mode,
        send_place,
        recv_place,
        stock_mode,
    )


@pytest.mark.parametrize(ARGS, _params("gloo 2000 x 8KiB"))
def test_gloo_many_leaves_into_cuda(
    benchmark, gloo_ranks, transfer_targets, name, impl, mode, send_place, recv_place, stock_mode
):
    _bench(
        benchmark,
        gloo_ranks,
        transfer_targets,
        name,
        impl,
        mode,
        send_place,
        recv_place,
        stock_mode,
    )


# --------------------------------------------------------------------------- matmul while a receive lands

MATMUL: dict[str, dict[str, Any]] = {
    "matmul + 1GiB receive (gloo)": dict(
        backend="gloo",
        leaves=200,
        total_bytes=GiB,
        mode="chunks 4MiB",
        send_place="cpu",
        recv_place="cuda",
        rounds=6,
        n=8192,
        dtype="bfloat16",
        fill=0.8,
        max_matmuls=800,
    ),
    "matmul + 1GiB receive (nccl)": dict(
        backend="nccl",
        leaves=200,
        total_bytes=GiB,
        mode="consolidated",
        send_place="cuda",
        recv_place="cuda",
        rounds=6,
        n=8192,
        dtype="bfloat16",
        fill=0.8,
        max_matmuls=800,
    ),
}
MATMUL_SLOWDOWN = 0.05
_matmul: dict[str, dict] = {}


def _matmul_rows(ranks: Ranks, name: str, targets: list[str]) -> dict[str, dict]:
    """Rows of the matmul case ``name`` (run once per session), keyed by row mode."""
    if name in _errors:
        raise RuntimeError(f"{name!r} failed earlier in this session:\n{_errors[name]}")
    if name not in _matmul:
        cfg = MATMUL[name]
        case = {k: cfg[k] for k in ("leaves", "total_bytes")}
        tb.check_case(dict(case, impl="cudarecv", mode=cfg["mode"]))
        try:
            per_rank = ranks.get().run(gb.matmul_interference, args=(cfg,), timeout=540)
        except RankError as error:
            _errors[name] = str(error)
            raise
        r = per_rank[tb.RECEIVER]
        transfer = gb.label(cfg)
        med = lambda xs: tb.median(sorted(xs))  # noqa: E731
        rows = {
            "matmul loop alone": dict(seconds=med(r["alone"]), all=r["alone"], bytes=0),
            f"matmul loop during {transfer}": dict(
                seconds=med(r["during"]), all=r["during"], bytes=0
            ),
            f"{transfer} alone": dict(
                seconds=med(r["recv_alone"]), all=r["recv_alone"], bytes=cfg["total_bytes"]
            ),
            f"{transfer} during matmul": dict(
                seconds=med(r["recv_during"]), all=r["recv_during"], bytes=cfg["total_bytes"]
            ),
        }
        for row in rows.values():
            row.update(
                ok=r["ok"],
                error=r["error"],
                matmuls=r["matmuls"],
                matmul_seconds=r["matmul_seconds"],
            )
        _matmul[name] = rows
        alone, during = (
            rows["matmul loop alone"]["seconds"],
            rows[f"matmul loop during {transfer}"]["seconds"],
        )
        slowdown = during / alone - 1
        recv = rows[f"{transfer} alone"]["seconds"]
        targets.append(
            f"{name}: matmul loop ({r['matmuls']} x {cfg['n']}^2 {cfg['dtype']}, {alone * 1e3:.1f} ms alone, "
            f"{during * 1e3:.1f} ms during a {recv * 1e3:.0f} ms receive): slowdown {slowdown * 100:+.1f}% "
            f"(target <= {MATMUL_SLOWDOWN * 100:g}%: {'met' if slowdown <= MATMUL_SLOWDOWN else 'MISSED'})"
        )
    return _matmul[name]


def _matmul_bench(benchmark, ranks: Ranks, targets: list[str], name: str, which: str) -> None:
    rows = _matmul_rows(ranks, name, targets)
    cfg = MATMUL[name]
    transfer = gb.label(cfg)
    mode = {
        "alone": "matmul loop alone",
        "during": f"matmul loop during {transfer}",
        "recv alone": f"{transfer} alone",
        "recv during": f"{transfer} during matmul",
    }[which]
    row = rows[mode]
    benchmark.extra_info.update(
        {
            "case": name,
            "impl": "cudarecv",
            "mode": mode,
            "bytes": row["bytes"],
            "leaves": cfg["leaves"],
            "backend": cfg["backend"],
            "matmuls": row["matmuls"],
            "matmul_seconds": row["matmul_seconds"],
            "suite_rounds": cfg["rounds"],
            "send_place": cfg["send_place"],
            "recv_place": cfg["recv_place"],
            "ok": row["ok"],
        }
    )
    tb.replay(
        benchmark, CLOCK, row["all"]
    )  # the loop's GPU seconds (CUDA events) or the receive's, per round
    assert row["ok"], f"{name}: the checked transfer delivered wrong data: {row['error']}"


WHICH = ["alone", "during", "recv alone", "recv during"]


@pytest.mark.parametrize("which", WHICH, ids=[w.replace(" ", "_") for w in WHICH])
def test_matmul_during_gloo_receive(benchmark, gloo_ranks, transfer_targets, which):
    _matmul_bench(benchmark, gloo_ranks, transfer_targets, "matmul + 1GiB receive (gloo)", which)


# --------------------------------------------------------------------------- NCCL


@nccl_mark
@pytest.mark.parametrize(ARGS, _params("nccl consolidated 256MiB"))
def test_nccl_consolidated_256mib(
    benchmark, nccl_ranks, transfer_targets, name, impl, mode, send_place, recv_place, stock_mode
):
    _bench(
        benchmark,
        nccl_ranks,
        transfer_targets,
        name,
        impl,
        mode,
        send_place,
        recv_place,
        stock_mode,
    )


@nccl_mark
@pytest.mark.parametrize(ARGS, _params("nccl 2000 x 8KiB"))
def test_nccl_many_leaves_batched(
    benchmark, nccl_ranks, transfer_targets, name, impl, mode, send_place, recv_place, stock_mode
):
    _bench(
        benchmark,
        nccl_ranks,
        transfer_targets,
        name,
        impl,
        mode,
        send_place,
        recv_place,
        stock_mode,
    )


@pytest.mark.gpus(2)
@pytest.mark.parametrize("which", WHICH, ids=[w.replace(" ", "_") for w in WHICH])
def test_matmul_during_nccl_receive(benchmark, nccl_ranks, transfer_targets, which):
    """Two real GPUs only: with both ranks on one GPU the sender's kernels would share the matmul's GPU."""
    if nccl_ranks.mode != "per_gpu":
        pytest.skip(
            "needs two GPUs: ranks sharing one GPU would put the sender's NCCL kernels on the "
            "matmul's GPU"
        )
    _matmul_bench(benchmark, nccl_ranks, transfer_targets, "matmul + 1GiB receive (nccl)", which)


# --------------------------------------------------------------------------- fan-out over NCCL

FANOUT_GPUS = 1  # as nccl_mark
FANOUT_BYTES = 256 * MiB
_FANOUT: dict[str, dict] = {}


@pytest.fixture(scope="module")
def nccl_three():
    yield from _nccl(3)


@pytest.mark.gpus(FANOUT_GPUS)
@pytest.mark.parametrize("method", ["relay", "star", "broadcast"])
def test_nccl_fanout_to_two(benchmark, nccl_three, transfer_targets, method):
    """256 MiB from rank 0's GPU to two receivers' GPUs: relay (p2p chain, 4 MiB chunks) vs star vs
    NCCL's own broadcast. Which of relay and broadcast a GPU user should run is this bench's answer."""
    if not _FANOUT:
        _FANOUT.update(
            nccl_three.get().run(gb.fanout_on_gpu, args=(FANOUT_BYTES, 5), timeout=600)[0]
        )
        med = {m: statistics.median(v) for m, v in _FANOUT["seconds"].items()}
        transfer_targets.append(
            f"nccl fan-out 256MiB to 2: relay {med['star'] / med['relay']:.2f}x star, "
            f"{med['broadcast'] / med['relay']:.2f}x NCCL broadcast"
        )
    impl, mode = {
        "relay": ("cudarecv", "relay"),
        "star": ("cudarecv", "star"),
        "broadcast": ("raw", "nccl broadcast"),
    }[method]
    benchmark.extra_info.update(
        case="nccl fan-out 256MiB to 2",
        impl=impl,
        mode=mode,
        bytes=FANOUT_BYTES,
        backend="nccl",
        ok=_FANOUT["ok"][method],
        send_place="cuda",
        recv_place="cuda",
        nccl_mode=nccl_three.mode,
    )
    tb.replay(benchmark, CLOCK, _FANOUT["seconds"][method])
    assert _FANOUT["ok"][method], f"{method}: a receiver holds wrong values"


# --------------------------------------------------------------------------- weight sync through CUDA IPC

IPC_BYTES = 256 * MiB
IPC_MODES = ["cuda ipc", "wire"]
_IPC: dict[str, Any] = {}


def time_ipc_weight_sync(rank: int, world: int, group: Any, total_bytes: int, rounds: int) -> dict:
    """GPU weights to a GPU receiver on GPU 0 of both ranks: through CUDA IPC (auto) and on the gloo wire
    (staged through page-locked memory), alternating; push-to-pull latency as the receiver measures it from the
    step's barrier, and device memory before and after."""
    import torch.distributed as dist

    import cudarecv

    device = torch.device("cuda", 0)
    td = TensorDict(
        {f"w{i:02d}": torch.zeros(total_bytes // 64 // 4, device=device) for i in range(64)}
    )
    ends = {}
    for mode in IPC_MODES:
        transport = "wire" if mode == "wire" else "auto"
        ends[mode] = (
            cudarecv.WeightSender(td, dst=1, timeout=120, transport=transport)
            if rank == 0
            else cudarecv.WeightReceiver(src=0, device=device, timeout=120, transport=transport)
        )
    seconds = {mode: [] for mode in IPC_MODES}
    memory, ok = [], True
    for step in range(1, rounds + 1):
        for mode in IPC_MODES[step % 2 :] + IPC_MODES[: step % 2]:
            if rank == 0:
                td.apply_(lambda t, v=step: t.fill_(float(v)))
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                ends[mode].push()
            else:
                ends[mode].pull()
                torch.cuda.current_stream().synchronize()
                seconds[mode].append(time.perf_counter() - start)
                ok &= all(bool((t == float(step)).all()) for t in ends[mode].td.values())
        if step in (2, rounds):
            memory.append((torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)))
    transports = {
        mode: (end.transports[1] if rank == 0 else end.transport) for mode, end in ends.items()
    }
    for end in ends.values():
        end.close()
    return {"seconds": seconds, "ok": ok, "memory": memory, "transports": transports}


@pytest.mark.parametrize("mode", IPC_MODES, ids=[m.replace(" ", "_") for m in IPC_MODES])
def test_cuda_ipc_weight_sync_256mib(benchmark, gloo_ranks, transfer_targets, mode):
    if not _IPC:
        out = gloo_ranks.get().run(time_ipc_weight_sync, args=(IPC_BYTES, 10), timeout=540)
        _IPC.update(out[tb.RECEIVER], sent_memory=out[0]["memory"])
        med = {m: tb.median(sorted(v)) for m, v in _IPC["seconds"].items()}
        transfer_targets.append(
            f"weight sync 256MiB GPU -> GPU (one GPU, two processes): CUDA IPC {med['cuda ipc'] * 1e3:.2f} ms, "
            f"wire {med['wire'] * 1e3:.2f} ms ({med['wire'] / med['cuda ipc']:.1f}x); device memory (allocated, "
            f"reserved) sender {_IPC['sent_memory']}, receiver {_IPC['memory']} (round 2 -> last)"
        )
    benchmark.extra_info.update(
        case="weight sync 256MiB GPU->GPU",
        impl="cudarecv",
        mode=mode,
        bytes=IPC_BYTES,
        leaves=64,
        backend="gloo",
        ok=_IPC["ok"],
        transport=_IPC["transports"][mode],
    )
    tb.replay(benchmark, CLOCK, _IPC["seconds"][mode])
    assert _IPC["ok"], "a version arrived with other values"
    assert _IPC["transports"][mode] == mode, (
        f"the {mode} row was carried by {_IPC['transports'][mode]}"
    )
