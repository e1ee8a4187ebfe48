"""The per-call plan lookup of a 2000-leaf tensordict: what every transfer pays before it posts.

A plan is reused only while every leaf keeps its data pointer and contiguity
(the stock wire, which posts the leaves themselves) and, where its byte layout is
used (the fast wire, GPU staging), its dtype and shape (``cudarecv/plan/plan.py``);
an unlocked tensordict is walked first. Timed in this process, no peers, with
pytest-benchmark's own clock: its stats are the lookup itself (``ok``: the lookup
found the plan built before).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from cudarecv.plan.plan import plan_for

LEAVES = 2000


@pytest.mark.parametrize("layout", [False, True], ids=["stock_wire", "fast_wire"])
@pytest.mark.parametrize("locked", [False, True], ids=["unlocked", "locked"])
def test_plan_lookup(benchmark, locked, layout):
    td = TensorDict({f"k{i:04d}": torch.zeros(2048) for i in range(LEAVES)})
    if locked:
        td.lock_()
    plan = plan_for(td)
    found = benchmark.pedantic(
        plan_for, args=(td, layout), rounds=200, iterations=1, warmup_rounds=5
    )
    mode = ("locked" if locked else "unlocked") + (
        ", + dtype and shape" if layout else ", pointers and contiguity"
    )
    benchmark.extra_info.update(
        {
            "case": f"plan lookup {LEAVES} leaves",
            "impl": "cudarecv",
            "mode": mode,
            "bytes": 0,
            "leaves": LEAVES,
            "backend": "cpu",
            "ok": found is plan,
        }
    )
    assert found is plan
