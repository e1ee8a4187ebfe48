"""Bad input: a clear exception naming the argument and the fix, before anything is sent."""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from tdfactory import make, same

# (call, kwargs without the td, expected exception, a regex the message must match)
BAD_CALLS = [
    ("irecv", {"src": 1, "group_src": 1}, cudarecv.ArgumentError, "`group_src` requires `group`"),
    ("irecv", {}, cudarecv.ArgumentError, "Exactly one of `src` and `group_src`"),
    ("isend", {"group_dst": 1}, cudarecv.ArgumentError, "`group_dst` requires `group`"),
    (
        "irecv",
        {"src": 7},
        cudarecv.ArgumentError,
        r"`src=7` is outside the world of 2 ranks.*0\.\.1",
    ),
    ("isend", {"dst": -1}, cudarecv.ArgumentError, "`dst=-1` is outside the world"),
    ("isend", {"dst": "SELF"}, cudarecv.ArgumentError, "own rank"),
    ("irecv", {"src": 1.0}, cudarecv.ArgumentTypeError, "`src` must be an int"),
    (
        "irecv",
        {"src": "PEER", "bucket_bytes": 0},
        cudarecv.ArgumentError,
        "`bucket_bytes` must be a positive int",
    ),
    (
        "isend",
        {"dst": "PEER", "bucket_bytes": -5},
        cudarecv.ArgumentError,
        "`bucket_bytes` must be a positive int",
    ),
    (
        "isend",
        {"dst": "PEER", "bucket_bytes": True},
        cudarecv.ArgumentError,
        "`bucket_bytes` must be a positive int",
    ),
    (
        "irecv",
        {"src": "PEER", "pseudo_rand": True, "init_tag": -1},
        cudarecv.ArgumentError,
        "`init_tag=-1` is negative.*pseudo_rand",
    ),
    (
        "irecv",
        {"src": "PEER", "init_tag": "3"},
        cudarecv.ArgumentTypeError,
        "`init_tag` must be an int",
    ),
    (
        "irecv",
        {"src": "PEER", "consolidated": True},
        cudarecv.ArgumentError,
        r"needs a consolidated tensordict.*consolidate\(metadata=True\)",
    ),
    (
        "irecv",
        {"src": "PEER", "bucket_bytes": 8, "init_tag": 1 << 29},
        cudarecv.ArgumentError,
        "out of range for the fast wire",
    ),
    # tags are what gloo takes (0 .. 2**31 - 1) for every leaf, checked before the first is posted
    (
        "irecv",
        {"src": "PEER", "init_tag": 2**31 - 1},
        cudarecv.ArgumentError,
        r"`init_tag=2147483647`.*5 leaves.*2\*\*31",
    ),
    (
        "isend",
        {"dst": "PEER", "init_tag": 2**31 - 3},
        cudarecv.ArgumentError,
        r"`init_tag=2147483645`.*5 leaves",
    ),
    (
        "isend",
        {"dst": "PEER", "init_tag": -1},
        cudarecv.ArgumentError,
        r"`init_tag=-1` is negative",
    ),
    (
        "irecv",
        {"src": "PEER", "group": "str"},
        cudarecv.ArgumentTypeError,
        r"`group` must be a torch.distributed process group.*str",
    ),
    (
        "irecv",
        {"src": "PEER", "group": []},
        cudarecv.ArgumentTypeError,
        r"`group` must be a torch.distributed process group.*list",
    ),
    (
        "isend",
        {"dst": "PEER", "group": 0},
        cudarecv.ArgumentTypeError,
        r"`group` must be a torch.distributed process group.*int",
    ),
]
STANDALONE_BAD = [
    (
        "irecv",
        {"src": "PEER", "group_src": "PEER"},
        cudarecv.ArgumentError,
        "`src` and `group_src` are mutually exclusive",
    ),
    (
        "irecv",
        {"src": "PEER"},
        cudarecv.ArgumentError,
        "standalone process group.*pass `group_src=",
    ),
    (
        "isend",
        {"group_dst": 2},
        cudarecv.ArgumentError,
        r"`group_dst=2` is outside `group` of 2 ranks",
    ),
    ("isend", {"group_dst": "SELF"}, cudarecv.ArgumentError, "own rank"),
]


def _fill(kwargs, rank):
    return {k: (1 - rank if v == "PEER" else rank if v == "SELF" else v) for k, v in kwargs.items()}


def bad_calls(rank, world, group, calls):
    """Every rank makes each bad call; then one good transfer proves nothing stray was sent."""
    out = []
    td = make("nested", float(rank))
    snapshot = td.clone()
    for name, kwargs, _, _ in calls:
        kwargs = _fill(kwargs, rank)
        if group is not None:
            kwargs["group"] = group
        try:
            getattr(cudarecv, name)(td, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported to the parent
            out.append((type(error).__name__, str(error)))
        else:
            out.append(None)
    untouched = same(td, snapshot)
    peer = (
        {"group": group, ("group_dst" if rank == 0 else "group_src"): 1 - rank}
        if group
        else {("dst" if rank == 0 else "src"): 1 - rank}
    )
    if rank == 0:
        cudarecv.send(td, **peer)
        return out, untouched, True
    cudarecv.recv(td, **peer)
    return out, untouched, same(td, make("nested", 0.0))


@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
def test_bad_input_raises_before_sending(cluster, standalone):
    calls = STANDALONE_BAD if standalone else BAD_CALLS
    results = cluster().run(bad_calls, args=(calls,), standalone=standalone)
    for rank, (out, untouched, link_ok) in enumerate(results):
        for (name, kwargs, exc, pattern), got in zip(calls, out):
            assert got is not None, f"rank {rank}: {name}({kwargs}) did not raise"
            assert got[0] == exc.__name__, f"rank {rank}: {name}({kwargs}) raised {got}"
            assert re.search(pattern, got[1]), f"{name}({kwargs}): {got[1]!r}"
        assert untouched and link_ok


STRIDED_OK = {
    "b"
}  # the non-contiguous leaf: it cannot travel as it is, a weight sender's snapshot takes it


def _bad_leaves():
    """(key, tensordict with that leaf, what the error must say)."""
    import warnings

    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors is in prototype stage")
    nested = [torch.zeros(2), torch.zeros(3)]
    return [
        ("b", TensorDict(a=torch.zeros(3), b=torch.zeros(4, 4).t()), "contiguous()"),
        ("s", TensorDict(a=torch.zeros(3), s=torch.zeros(4, 4).to_sparse()), "to_dense()"),
        ("m", TensorDict(a=torch.zeros(3), m=torch.empty(3, device="meta")), "meta"),
        ("n", TensorDict(a=torch.zeros(3), n=torch.nested.nested_tensor(nested)), "nested tensor"),
        (
            "j",
            TensorDict(a=torch.zeros(3), j=torch.nested.nested_tensor(nested, layout=torch.jagged)),
            "nested tensor",
        ),
    ]


def leaf_checks(rank, world, group):
    """Each bad leaf through isend, irecv and WeightSender: (key, call, exception class, message)."""
    calls = {
        "irecv": lambda td: cudarecv.irecv(td, src=1 - rank),
        "isend": lambda td: cudarecv.isend(td, dst=1 - rank),
        "WeightSender": lambda td: cudarecv.WeightSender(td, dst=1 - rank, timeout=2.0),
    }
    errors = []
    for key, td, _ in _bad_leaves():
        for name, call in calls.items():
            if key in STRIDED_OK and name == "WeightSender":
                continue  # (a weight sender copies its leaves into a snapshot: a strided one is taken)
            try:
                call(td)
            except Exception as error:  # noqa: BLE001 - reported to the parent
                errors.append((key, name, type(error).__name__, str(error)))
            else:
                errors.append((key, name, None, ""))
    return errors


def test_leaves_that_cannot_travel_are_named(cluster):
    errors = cluster().run(leaf_checks)[0]
    expected = {key: fix for key, _, fix in _bad_leaves()}
    assert len(errors) == 3 * len(expected) - len(STRIDED_OK)
    for key, name, kind, message in errors:
        assert kind == "ArgumentError", (key, name, kind, message)
        assert f"leaf {key!r} cannot travel" in message and expected[key] in message, (
            key,
            name,
            message,
        )


def test_not_a_tensordict():
    from cudarecv.plan.walk import unwrap

    with pytest.raises(TypeError, match="`td` must be a TensorDict"):
        unwrap({"a": torch.zeros(1)})


def test_unsupported_leaf_type_names_key():
    from cudarecv.plan.walk import walk

    td = TensorDict(a=torch.zeros(1))
    td._tensordict["x"] = object()  # bypass tensordict's own checks
    with pytest.raises(TypeError, match="leaf 'x' is a object, which cannot travel"):
        walk(td)


def test_no_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        cudarecv.irecv(make("flat", 0.0), src=0)


def numpy_init_tag(rank, world, group):
    import numpy as np

    from cudarecv.p2p.stock import Stock

    td = make("nested", 4.0 if rank == 0 else 0.0)
    if rank == 0:
        Stock.send(td, 1, init_tag=np.int64(3))
        return cudarecv.send(td, 1, init_tag=np.int64(3), pseudo_rand=True)
    ret = cudarecv.recv(td, 0, init_tag=np.int64(3))
    ok = same(td, make("nested", 4.0))
    td.zero_()
    Stock.recv(td, 0, init_tag=np.int64(3), pseudo_rand=True)
    return ret, ok and same(td, make("nested", 4.0))


def test_numpy_integer_init_tag_is_accepted_as_stock_accepts_it(cluster):
    _, (ret, ok) = cluster().run(numpy_init_tag)
    assert ok and ret == 3 + 5 - 1
