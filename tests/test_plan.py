"""Per-tensordict plans: cached while the leaves are unchanged, rebuilt on any change; stock order."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.plan.plan import plan_for
from cudarecv.plan.walk import format_path, walk
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


def test_an_unchanged_plain_tensordict_is_not_walked_again(monkeypatch):
    from cudarecv.plan import plan as _plan

    td = TensorDict(a=TensorDict(x=torch.zeros(3), y=torch.ones(2)), b=torch.zeros(4))
    plan = plan_for(td)
    assert plan.skeleton is not None
    walks = []
    monkeypatch.setattr(_plan, "walk", lambda t: walks.append(t) or walk(t))
    assert (
        plan_for(td) is plan and walks == []
    )  # the skeleton said: the same dicts, keys and leaves

    def changed(change, expect_paths):
        fresh = plan_for(td)
        assert walks and fresh.paths == expect_paths, change
        walks.clear()
        assert plan_for(td) is fresh and walks == [], (
            change
        )  # and the new skeleton holds from then on
        return fresh

    td["a", "x"] = torch.ones(3)  # a nested leaf replaced under its key
    assert changed("nested leaf", [("a", "x"), ("a", "y"), ("b",)]) is not plan
    td["a"] = TensorDict(x=torch.zeros(3), y=torch.ones(2))  # a nested tensordict replaced
    changed("nested tensordict", [("a", "x"), ("a", "y"), ("b",)])
    td.rename_key_("b", "c")  # the same leaf under another key
    changed("renamed", [("a", "x"), ("a", "y"), ("c",)])
    del td["a", "y"]
    changed("deleted", [("a", "x"), ("c",)])
    td["a", "z"] = torch.zeros(1)
    changed("added", [("a", "x"), ("a", "z"), ("c",)])
    td["c"].resize_(2)  # in place, under the same key: the leaves' signatures catch it
    assert plan_for(td).nbytes[-1] == 8


def test_plan_is_dropped_with_its_tensordict():
    import gc

    from cudarecv.plan import plan as _plan

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
    assert list(plan.tags(5, 3, False)) == [5, 6, 7]


def test_pack_unpack_roundtrip_any_piece_size():
    for piece in (1, 3, 8, 13, 1 << 20):
        src, dst = make("nested", 2.0), make("nested", 0.0)
        p_src, p_dst = plan_for(src), plan_for(dst)
        n = len(p_src.pieces(piece))
        assert n == -(-p_src.total // piece)
        p_src.pack(piece, "cpu")
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


# -- a leaf changed in place (same object, same data pointer) gets a new plan --------------


def test_plan_sees_a_leaf_resized_in_place():
    td = TensorDict(a=torch.zeros(8), b=torch.zeros(3))
    plan = plan_for(td)
    td["a"].resize_(4)  # same tensor object, same data pointer, fewer bytes
    fresh = plan_for(td)
    assert fresh is not plan and fresh.nbytes == [16, 12] and fresh.byte_views[0].numel() == 16


def test_plan_sees_a_dtype_reinterpretation():
    td = TensorDict(a=torch.zeros(8), b=torch.zeros(3))
    plan = plan_for(td)
    schema = plan.bucket_header.schema
    leaf = td["a"]
    leaf.data = leaf.data.view(torch.int32)  # same object, same pointer, other dtype
    fresh = plan_for(td)
    assert fresh is not plan and fresh.tensors[0].dtype == torch.int32
    assert fresh.bucket_header.schema != schema


def test_locked_plan_sees_a_leaf_transposed_in_place():
    td = TensorDict(m=torch.zeros(4, 3), b=torch.zeros(2)).lock_()
    plan = plan_for(td)
    plan.check()
    td["m"].t_()  # now 3 x 4, not contiguous; the td stays locked
    fresh = plan_for(td)
    assert fresh is not plan
    with pytest.raises(ValueError, match="leaf 'm' cannot travel.*not contiguous"):
        fresh.check()


def test_plan_sees_a_new_storage_offset():
    base = torch.arange(10.0)
    leaf = base[:4]
    td = TensorDict(a=leaf)
    plan = plan_for(td)
    td["a"].set_(base.untyped_storage(), 2, (4,))  # same object, a view 8 bytes further on
    assert plan_for(td) is not plan


# -- the same changes once torch's C++ layout check answers for the plan (Plan.unchanged) -----------------

CHANGES = {
    "resize_": lambda td: td["m"].resize_(3),
    "t_": lambda td: td["m"].t_(),
    "unsqueeze_": lambda td: td["m"].unsqueeze_(0),
    "as_strided_": lambda td: td["m"].as_strided_((6, 2), (2, 1)),
    "set_ other storage, same shape": lambda td: td["m"].set_(torch.zeros(4, 3)),
    "set_ other offset": lambda td: td["m"].set_(td["m"].untyped_storage(), 1, (2, 3)),
    ".data = a dtype view": lambda td: setattr(td["m"], "data", td["m"].data.view(torch.int32)),
    ".data = a reshaped view": lambda td: setattr(td["m"], "data", td["m"].data.view(3, 4)),
}


@pytest.mark.parametrize("guarded", [True, False], ids=["torch_guard", "python_only"])
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("locked", [False, True], ids=["unlocked", "locked"])
def test_a_leaf_changed_in_place_after_the_layout_guard_is_built_gets_a_new_plan(
    monkeypatch, change, guarded, locked
):
    if not guarded:
        # a torch without TensorGuards (or with other arguments): the Python comparison alone
        monkeypatch.setattr("cudarecv.plan.plan._layout_guard", lambda tensors: False)
    td = TensorDict(m=torch.zeros(4, 3), b=torch.zeros(2))
    if locked:
        td.lock_()
    plan = plan_for(td)
    # the second call makes the guard, the third uses it
    assert plan_for(td) is plan and plan_for(td) is plan
    assert bool(plan._guard) is guarded
    CHANGES[change](td)
    fresh = plan_for(td)
    assert fresh is not plan
    leaf, i = td["m"], fresh.paths.index(("m",))
    assert [column[i] for column in fresh.signature] == [
        leaf.data_ptr(),
        leaf.is_contiguous(),
        leaf.dtype,
        leaf.shape,
    ]


def test_a_change_the_layout_guard_sees_but_the_plan_does_not_keep_the_plan_and_the_python_check():
    """``requires_grad`` is not part of a plan: the guard fails on it, the plan stays, and the plan asks the
    Python comparison from then on (a guard that always fails would cost its check on every call)."""
    td = TensorDict(m=torch.zeros(4, 3), b=torch.zeros(2))
    plan = plan_for(td)
    plan_for(td)
    assert plan._guard
    td["m"].requires_grad_()
    assert plan_for(td) is plan and plan._guard is False
    td["m"].data = torch.zeros(4, 3)  # still seen, by the Python comparison
    assert plan_for(td) is not plan


def test_a_leaf_changed_while_the_layout_guard_is_made_is_not_what_the_guard_holds(monkeypatch):
    """Another thread resizes a leaf between the Python comparison and the guard's making (injected here): the
    guard, which holds the leaves as they are when made, is not kept, and the next call sees the change."""
    from cudarecv.plan import plan as plan_module

    made = plan_module._layout_guard
    td = TensorDict(m=torch.zeros(4, 3), b=torch.zeros(2))

    def racing(tensors):
        td["m"].resize_(3)
        return made(tensors)

    monkeypatch.setattr(plan_module, "_layout_guard", racing)
    plan = plan_for(td)
    plan_for(td)  # compares equal, then makes the guard after the resize
    assert not plan._guard
    monkeypatch.setattr(plan_module, "_layout_guard", made)
    fresh = plan_for(td)
    assert fresh is not plan and fresh.signature[3][fresh.paths.index(("m",))] == torch.Size([3])


def test_a_torch_whose_tensor_guard_misses_a_change_is_not_asked(monkeypatch):
    """The guard's meaning is checked once per process: one that passes a tensor of another size (made here by
    leaving every size free, as torch.compile does for dynamic dimensions) leaves plans to the Python check."""
    from torch._C._dynamo import guards

    from cudarecv.plan import plan as plan_module

    def lax(tensors):
        return guards.TensorGuards(
            *tensors,
            dynamic_dims_sizes=[[None] * t.dim() for t in tensors],
            dynamic_dims_strides=[[None] * t.dim() for t in tensors],
        )

    plan_module._guards_work.cache_clear()
    monkeypatch.setattr(plan_module, "_make_guard", lax)
    try:
        assert not plan_module._guards_work()
        td = TensorDict(m=torch.zeros(4, 3), b=torch.zeros(2))
        plan = plan_for(td)
        assert plan_for(td) is plan and plan._guard is False
        td["m"].resize_(3)
        assert plan_for(td) is not plan
    finally:
        plan_module._guards_work.cache_clear()


def shrunk_sender(rank, world, group, bucket_bytes):
    """A sender leaf shrunk in place between two transfers sends its new size, not stale bytes."""
    td = TensorDict(a=torch.arange(8.0), b=torch.ones(2))
    if rank == 0:
        cudarecv.send(td, 1, bucket_bytes=bucket_bytes)
        td["a"].resize_(4).copy_(torch.tensor([9.0, 8.0, 7.0, 6.0]))
        cudarecv.send(td, 1, bucket_bytes=bucket_bytes)
        return None
    first, second = (
        TensorDict(a=torch.zeros(8), b=torch.zeros(2)),
        TensorDict(a=torch.zeros(4), b=torch.zeros(2)),
    )
    cudarecv.recv(first, 0, bucket_bytes=bucket_bytes)
    cudarecv.recv(second, 0, bucket_bytes=bucket_bytes)
    return first["a"].tolist(), second["a"].tolist()


@pytest.mark.parametrize("bucket_bytes", [None, 16], ids=["stock_wire", "fast_wire"])
def test_a_sender_leaf_shrunk_in_place_sends_its_new_size(cluster, bucket_bytes):
    _, (first, second) = cluster().run(shrunk_sender, args=(bucket_bytes,))
    assert first == [float(i) for i in range(8)] and second == [9.0, 8.0, 7.0, 6.0]


def changed_receiver(rank, world, group, change):
    """A receiver leaf changed in place is checked against the sender's header again."""
    td = TensorDict(a=torch.arange(8.0) + 10 * rank, b=torch.ones(2))
    if rank == 0:
        cudarecv.send(td, 1, bucket_bytes=16)
        cudarecv.send(td, 1, bucket_bytes=16)
        return None
    cudarecv.recv(td, 0, bucket_bytes=16)
    leaf = td["a"]
    if change == "resize":
        leaf.resize_(4)
    else:
        leaf.data = leaf.data.view(torch.int32)
    storage = leaf.untyped_storage()
    before = bytes(storage)
    try:
        cudarecv.recv(td, 0, bucket_bytes=16)
        outcome = "accepted"
    except cudarecv.HeaderError as error:
        outcome = str(error)
    return outcome, bytes(storage) == before


@pytest.mark.parametrize("change", ["resize", "dtype_view"])
def test_a_receiver_leaf_changed_in_place_is_checked_again(cluster, change):
    _, (outcome, untouched) = cluster().run(changed_receiver, args=(change,))
    assert "mismatch" in outcome and untouched, outcome


# -- caches keyed by per-call arguments stay bounded --------------------------------------


def varying_calls(rank, world, group, calls):
    import tracemalloc

    td = TensorDict({f"k{i:04d}": torch.full((4,), float(rank)) for i in range(500)})
    peer = 1 - rank
    call = cudarecv.send if rank == 0 else cudarecv.recv

    def one(i):
        call(td, peer, init_tag=7 * i, pseudo_rand=bool(i % 2))
        call(
            td, peer, bucket_bytes=(64 + 8 * i) if rank == 0 else 64
        )  # the sender picks the piece size

    for i in range(4):
        one(i)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(4, calls):
        one(i)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    plan = plan_for(td)
    return grown, len(plan._tags), len(plan._pieces)


def test_per_call_caches_are_bounded(cluster):
    for grown, tags, pieces in cluster().run(varying_calls, args=(100,), timeout=120):
        assert tags <= 8 and pieces <= 8, (
            tags,
            pieces,
        )  # (96 calls of distinct arguments: 12 times the bound)
        assert grown < 1 << 19, f"Python memory grew by {grown / 2**20:.2f} MiB over 96 calls"
