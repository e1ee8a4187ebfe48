"""Per-tensordict plans: cached while the leaves are unchanged, rebuilt on any change; stock order."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from cudarecv._plan import plan_for
from cudarecv._walk import format_path, walk
from tdfactory import make


def test_walk_order_is_stock_order():
    paths, _ = walk(make("nested", 0.0))
    assert paths == [("a", "x", "q"), ("a", "y"), ("b",), ("c",), ("flag",)]  # sorted, text skipped
    paths, _ = walk(make("lazy", 0.0))
    assert paths == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    paths, _ = walk(make("tensorclass", 0.0)._tensordict)
    assert paths == [("obs",), ("reward",)]
    assert format_path((0, "a", "b")) == "[0].a.b"


def test_plan_is_cached_and_invalidated():
    td = make("nested", 0.0)
    plan = plan_for(td)
    assert plan_for(td) is plan
    td["b"].add_(1)  # in-place data change: same plan
    assert plan_for(td) is plan
    td["b"] = torch.ones(4)  # a new leaf tensor: new plan
    assert plan_for(td) is not plan
    plan = plan_for(td)
    td["b"].set_(torch.zeros(4))  # same tensor object, other storage: new plan
    assert plan_for(td) is not plan
    plan = plan_for(td)
    td["new"] = torch.zeros(2)  # new key
    fresh = plan_for(td)
    assert fresh is not plan and ("new",) in fresh.paths


def test_plan_is_dropped_with_its_tensordict():
    import gc

    from cudarecv import _plan

    td = TensorDict(a=torch.zeros(2))
    plan_for(td)
    key = id(td)
    assert key in _plan._PLANS
    del td
    gc.collect()
    assert key not in _plan._PLANS


def test_tags_cached_per_plan():
    plan = plan_for(make("flat", 0.0))
    tags = plan.tags(0, 3, True)
    assert plan.tags(0, 3, True) is tags and tags == [9651, 3450, 3834]
    assert plan.tags(5, 3, False) == [5, 6, 7]


def test_pack_unpack_roundtrip_any_piece_size():
    for piece in (1, 3, 8, 13, 1 << 20):
        src, dst = make("nested", 2.0), make("nested", 0.0)
        p_src, p_dst = plan_for(src), plan_for(dst)
        n = len(p_src.pieces(piece))
        assert n == -(-p_src.total // piece)
        p_src.pack("cpu")
        p_dst.staging("cpu").copy_(p_src.staging("cpu"))
        for i in range(n):
            p_dst.unpack(piece, i)
        assert all(torch.equal(a, b) for a, b in zip(walk(src)[1], walk(dst)[1])), piece


def test_locked_plan_lives_in_the_lock_cache():
    td = make("nested", 0.0).lock_()
    plan = plan_for(td)
    assert plan_for(td) is plan and td._cache["cudarecv_plan"] is plan
    td.unlock_()  # tensordict erases its cache on unlock
    td["b"] = torch.ones(4)
    assert plan_for(td) is not plan


def test_locked_plan_sees_new_storage():
    td = make("flat", 0.0).lock_()
    plan = plan_for(td)
    td["z"].data = torch.ones(3)  # same tensor object, new storage
    assert plan_for(td) is not plan
