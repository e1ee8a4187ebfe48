"""Wire compatibility with stock tensordict (0.15.3, and 0.14.3 in the second CI environment), both directions, every mode, both group kinds.

Each case runs on two real spawned ranks over gloo: rank 0 sends, rank 1
receives, with stock tensordict on one end and cudarecv on the other (or on
both). The receiver checks every leaf and the call's return value.
"""

from __future__ import annotations

import pytest

import cudarecv
from cudarecv.p2p.stock import STOCK_CONSOLIDATED_ISEND, Stock
from tdfactory import STRUCTURES, leaves, make, same

MODES = {
    "plain": {},
    "init_tag": {"init_tag": 17},
    "pseudo_rand": {"pseudo_rand": True, "init_tag": 3},
    "consolidated": {"consolidated": True},
}


def _stock_call(name, td, *args, **kwargs):
    from tensordict.utils import _is_tensorclass

    inner = td._tensordict if _is_tensorclass(type(td)) else td
    return getattr(Stock, name)(inner, *args, **kwargs)


def _call(impl, name, td, *args, **kwargs):
    if impl == "stock":
        return _stock_call(name, td, *args, **kwargs)
    return getattr(cudarecv, name)(td, *args, **kwargs)


def transfer(rank, world, group, sender, receiver, blocking, opts):
    peer = (
        {"group": group, "group_dst" if rank == 0 else "group_src": 1 - rank}
        if group is not None
        else {}
    )
    results = {}
    for structure in STRUCTURES:
        td = make(structure, fill=7.0 if rank == 0 else 0.0)
        if opts.get("consolidated"):
            td = td.consolidate(metadata=True)
        args = () if group is not None else (1 - rank,)
        if rank == 0:
            if blocking:
                _call(sender, "send", td, *args, **peer, **opts)
            else:
                out = _call(sender, "isend", td, *args, **peer, return_early=True, **opts)
                for work in out:
                    work.wait()
            continue
        if blocking:
            ret = _call(receiver, "recv", td, *args, **peer, **opts)
        else:
            futures = _call(receiver, "irecv", td, *args, **peer, return_premature=True, **opts)
            for f in futures:
                f.wait()
            ret = None
        results[structure] = (same(td, make(structure, 7.0)), ret)
    return results


PAIRS = [("stock", "cudarecv"), ("cudarecv", "stock"), ("cudarecv", "cudarecv")]


@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
@pytest.mark.parametrize("blocking", [True, False], ids=["send_recv", "isend_irecv"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sender,receiver", PAIRS, ids=[f"{s}->{r}" for s, r in PAIRS])
def test_wire_compatible(cluster, sender, receiver, mode, blocking, standalone):
    opts = MODES[mode]
    if (
        opts.get("consolidated")
        and not blocking
        and "stock" in (sender, receiver)
        and not STOCK_CONSOLIDATED_ISEND
    ):
        pytest.skip(
            "this tensordict's isend/irecv have no consolidated= (0.14): its send/recv are the stock peer"
        )
    _, results = cluster().run(
        transfer, args=(sender, receiver, blocking, opts), standalone=standalone
    )
    for structure, (ok, ret) in results.items():
        assert ok, f"{structure}: received values differ from the sent ones"
        if blocking and not opts.get("consolidated"):
            n = len(leaves(make(structure, 0.0)))
            init = opts.get("init_tag", 0)
            tags = cudarecv.tag_sequence(init, n, pseudo_rand=opts.get("pseudo_rand", False))
            assert ret == (int(tags[-1]) if n else init - 1), f"{structure}: recv returned {ret}"


def stock_return_values(rank, world, group):
    """What stock and cudarecv return from each call, side by side (rank 1)."""
    out = []
    for impl in ("stock", "cudarecv"):
        td = make("nested", float(rank))
        if rank == 0:
            calls = [
                _call(impl, "isend", td, 1),
                _call(impl, "send", td, 1),
                _call(impl, "send", td, 1, consolidated=True),
            ]
            if STOCK_CONSOLIDATED_ISEND:
                calls.append(_call(impl, "isend", td, 1, consolidated=True))
        else:
            cons = make("nested", 0.0).consolidate(metadata=True)
            calls = [
                _call(impl, "irecv", td, 0),
                _call(impl, "recv", td, 0),
                _call(impl, "recv", cons, 0, consolidated=True),
            ]
            if STOCK_CONSOLIDATED_ISEND:
                calls.append(_call(impl, "irecv", cons, 0, consolidated=True))
        out.append(calls)
    return out


def test_return_values_match_stock(cluster):
    sent, received = cluster().run(stock_return_values)
    assert sent[0] == sent[1]
    assert received[0] == received[1]


def smaller_sender(rank, world, group):
    """Rank 0 sends 4 floats per leaf (per leaf, then consolidated), by stock and by cudarecv; rank 1 receives
    each into 8 floats of -1 by cudarecv and by stock: what each receiver holds after."""
    import torch
    from tensordict import TensorDict

    got = []
    for opts in ({}, {"consolidated": True}):
        for impl in ("stock", "cudarecv"):
            if rank == 0:
                td = TensorDict(a=torch.arange(4.0), b=torch.arange(4.0) + 10).consolidate(
                    metadata=True
                )
                _call(impl, "send", td, 1, **opts)
                continue
            td = TensorDict(a=torch.full((8,), -1.0), b=torch.full((8,), -1.0)).consolidate(
                metadata=True
            )
            _call("cudarecv" if impl == "stock" else "stock", "recv", td, 0, **opts)
            got.append((td["a"].tolist(), td["b"].tolist()))
    return got


def test_the_stock_wire_checks_no_sizes_as_stock_does(cluster):
    """Documented (README, wire compatibility): a stock-wire message carries no length, so a receiver leaf
    larger than the sender's is filled with the sender's bytes and the rest is left, by cudarecv as by stock;
    consolidated, the storage takes the sender's storage from its start (a smaller receiver dies in gloo)."""
    _, got = cluster().run(smaller_sender)
    per_leaf = ([0.0, 1.0, 2.0, 3.0] + [-1.0] * 4, [10.0, 11.0, 12.0, 13.0] + [-1.0] * 4)
    consolidated = ([0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], [-1.0] * 8)
    assert got == [per_leaf, per_leaf, consolidated, consolidated], got
