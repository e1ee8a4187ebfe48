"""Pseudo-random tags for 100k leaves: cudarecv's tag map vs stock ``_int_generator``.

Each round runs in a fresh ``sys.executable`` child, so the cudarecv number
includes importing ``cudarecv.plan.tags`` (hence the ``cudarecv`` package) and
building the tag map. The child times itself; process start-up is not part
of it. Both children import numpy, torch and tensordict
(shared dependencies, ~1 s) before their timer; the stock child then times
``from tensordict.utils import _int_generator`` plus the 100k-call loop.

Each bench's pytest-benchmark rounds are the children's own times (one per
child), replayed through a virtual clock (``tb.VirtualClock``), so ``stats`` is
what the children measured, not their start-up. ``ok`` (cudarecv's row): its
tags are stock's, compared by SHA-256 (the stock row is the reference, not
checked).

Children may write bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped) and one
untimed cudarecv child runs first, so cudarecv's modules load from ``.pyc`` as
in any installed package (site-packages already has tensordict's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cudarecv.tools import transfer_ranks as tb

ROOT = Path(__file__).resolve().parents[1]
LEAVES = 100_000
STOCK_ROUNDS, CUDARECV_ROUNDS = 1, 3  # the stock child takes seconds

CLOCK = tb.VirtualClock("child_clock")
pytestmark = [pytest.mark.timeout(600), pytest.mark.benchmark(timer=CLOCK)]

_OURS = f"""
import hashlib, json, time
import numpy as np, torch, tensordict
t0 = time.perf_counter()
import cudarecv.plan.tags
tags = cudarecv.plan.tags.tag_sequence(0, {LEAVES}, pseudo_rand=True)
t1 = time.perf_counter()
print(json.dumps({{"seconds": t1 - t0, "sha": hashlib.sha256(np.asarray(tags, np.int64).tobytes()).hexdigest()}}))
"""

_STOCK = f"""
import hashlib, json, time
import numpy as np, torch
s0 = time.perf_counter()
import tensordict
s1 = time.perf_counter()
t0 = time.perf_counter()
from cudarecv.p2p.stock import int_generator as _int_generator
tag, tags = -1, []
for _ in range({LEAVES}):
    tag = _int_generator(tag + 1)
    tags.append(tag)
t1 = time.perf_counter()
print(json.dumps({{"seconds": t1 - t0, "setup_seconds": s1 - s0,
                  "sha": hashlib.sha256(np.asarray(tags, np.int64).tobytes()).hexdigest()}}))
"""

_results: dict[str, dict] = {}


def _run_child(code: str) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _record(benchmark, impl: str, runs: list[dict]) -> float:
    """The bench's extra_info and rounds (the children's own times); returns their median."""
    seconds = [r["seconds"] for r in runs]
    benchmark.extra_info.update(
        case="tags 100k", impl=impl, mode="pseudo_rand", bytes=0, leaves=LEAVES
    )
    tb.replay(benchmark, CLOCK, seconds)
    return statistics.median(seconds)


def _report_ratio(benchmark) -> None:
    if "stock" in _results and "cudarecv" in _results:
        stock, ours = _results["stock"], _results["cudarecv"]
        ok = stock["sha"] == ours["sha"]
        if benchmark.extra_info.get("impl") == "cudarecv":
            benchmark.extra_info["ok"] = ok
        assert ok, "cudarecv tags differ from stock tensordict tags"
        ratio = stock["seconds"] / ours["seconds"]
        benchmark.extra_info["speedup_vs_stock"] = ratio
        print(
            f"\ntags 100k pseudo_rand, fresh process: stock {stock['seconds'] * 1e3:.1f} ms, "
            f"cudarecv {ours['seconds'] * 1e3:.2f} ms, ratio {ratio:.0f}x"
        )


def test_tags_100k_stock(benchmark) -> None:
    runs = [_run_child(_STOCK) for _ in range(STOCK_ROUNDS)]
    seconds = _record(benchmark, "stock", runs)
    benchmark.extra_info["child_setup_seconds"] = runs[0]["setup_seconds"]
    _results["stock"] = {"seconds": seconds, "sha": runs[0]["sha"]}
    _report_ratio(benchmark)


def test_tags_100k_cudarecv(benchmark) -> None:
    _run_child(_OURS)  # untimed: writes cudarecv's .pyc files
    runs = [_run_child(_OURS) for _ in range(CUDARECV_ROUNDS)]
    seconds = _record(benchmark, "cudarecv", runs)
    assert len({r["sha"] for r in runs}) == 1
    _results["cudarecv"] = {"seconds": seconds, "sha": runs[0]["sha"]}
    _report_ratio(benchmark)
