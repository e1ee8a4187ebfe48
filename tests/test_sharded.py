"""Sharded weight sync (issue 29): FSDP2 / DTensor trainers push without a gather into receivers of any layout.

Every rank of a six-rank gloo world creates every mesh, in the same order (DeviceMesh creation is collective
over the world). Versions are exact integers in float64 (``1000 * version + the element's index in the whole
tensor``), so any element out of place, missed, or from another version shows; what each rank holds or should
hold is cut by torch's own ``_compute_local_shape_and_global_offset``, an oracle independent of
:mod:`cudarecv.plan.boxes`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import cudarecv
from cudarecv.plan.boxes import Box, coordinates, duty, shard_box
from cudarecv.testing.launch import Cluster, Ranks
from held import stacks, threads
from procs import stop_here
from rawwire import store

SHAPES = {
    "0.weight": (7, 5),
    "0.bias": (7,),
    "2.weight": (3, 7),
    "2.bias": (3,),
}  # uneven on 2, 4 ranks


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)
    ).double()


def whole(name: str, version: int) -> torch.Tensor:
    shape = SHAPES[name]
    return (
        torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 1000.0 * version
    ).reshape(shape)


def oracle_slice(shape, mesh, placements) -> tuple[slice, ...]:
    """This rank's part of a tensor of ``shape`` placed on ``mesh``, as torch computes it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def set_version(td: TensorDict, version: int) -> None:
    """Write version ``version`` into each rank's shards of ``td`` (DTensor leaves), in place, no collective."""
    with torch.no_grad():
        for key, t in td.items(True, True):
            name = ".".join(key)
            t.to_local().copy_(
                whole(name, version)[oracle_slice(t.shape, t.device_mesh, t.placements)]
            )


def holds(td: TensorDict, version: int) -> bool:
    """Whether a receiver's ``td`` holds exactly ``version``: each DTensor leaf its local part, each plain one whole."""
    for key, t in td.items(True, True):
        name = ".".join(key)
        want = whole(name, version)
        if hasattr(t, "device_mesh"):
            got, want = t.to_local(), want[oracle_slice(t.shape, t.device_mesh, t.placements)]
        else:
            got = t
        if not torch.equal(got, want):
            return False
    return True


def expect_on(mesh, placements_of) -> TensorDict:
    """An ``expect`` of DTensors on ``mesh`` (``placements_of(name)``), built without a collective."""
    from torch.distributed.tensor import DTensor

    leaves = {}
    for name, shape in SHAPES.items():
        placements = placements_of(name)
        local = torch.zeros(
            whole(name, 0)[oracle_slice(shape, mesh, placements)].shape, dtype=torch.float64
        )
        leaves[tuple(name.split("."))] = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=torch.empty(shape).stride(),
        )
    return TensorDict(leaves, [])


def no_gathers(monkeypatch_like: dict) -> None:
    """Make every gathering call raise on this rank (a push that gathers then fails)."""
    from torch.distributed.tensor import DTensor

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"a push called {name}")

        return call

    for name in (
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "gather",
        "broadcast",
        "all_reduce",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ):
        monkeypatch_like[("dist", name)] = getattr(dist, name)
        setattr(dist, name, refuse(f"torch.distributed.{name}"))
    for name in ("full_tensor", "redistribute"):
        monkeypatch_like[("DTensor", name)] = getattr(DTensor, name)
        setattr(DTensor, name, refuse(f"DTensor.{name}"))


def restore(saved: dict) -> None:
    from torch.distributed.tensor import DTensor

    for (owner, name), value in saved.items():
        setattr(dist if owner == "dist" else DTensor, name, value)


def meshes():
    """Every mesh any case uses, created on every rank in one order."""
    from torch.distributed.device_mesh import DeviceMesh

    return {
        "t2": DeviceMesh("cpu", [0, 1]),
        "t4": DeviceMesh("cpu", [0, 1, 2, 3]),
        "hsdp": DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard")),
        "r2": DeviceMesh("cpu", [2, 3]),
        "r45": DeviceMesh("cpu", [4, 5]),
        "r2d": DeviceMesh("cpu", [[2, 3], [4, 5]]),
    }


def tensor_parallel(name: str):
    """Megatron's cut: the first layer column-parallel (rows of its weight and its bias), the second row-parallel
    (columns of its weight), its bias whole on each."""
    from torch.distributed.tensor import Replicate, Shard

    return {
        "0.weight": [Shard(0)],
        "0.bias": [Shard(0)],
        "2.weight": [Shard(1)],
        "2.bias": [Replicate()],
    }[name]


def two_d(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {
        "0.weight": [Shard(0), Shard(1)],
        "0.bias": [Replicate(), Shard(0)],
        "2.weight": [Shard(1), Shard(0)],
        "2.bias": [Shard(0), Replicate()],
    }[name]


VERSIONS = 3
CASES = {  # trainer ranks and their mesh; receiver rank -> its layout: a mesh and placements, "module", or None
    "fsdp2_to_full_and_tp": (
        [0, 1],
        "t2",
        {2: ("r2", tensor_parallel), 3: ("r2", tensor_parallel), 4: "module", 5: None},
    ),
    "fsdp4_to_tp": ([0, 1, 2, 3], "t4", {4: ("r45", tensor_parallel), 5: ("r45", tensor_parallel)}),
    "hsdp_to_full": ([0, 1, 2, 3], "hsdp", {4: "module", 5: None}),
    "fsdp2_to_2d": ([0, 1], "t2", {r: ("r2d", two_d) for r in (2, 3, 4, 5)}),
    "columns_to_tp_and_full": (
        [0, 1],
        "t2",
        {2: ("r2", tensor_parallel), 3: ("r2", tensor_parallel), 4: "module", 5: None},
    ),
}


def columns(name: str):
    """Trainer DTensors that are no FSDP2 model's: weights cut by columns, biases whole on each rank."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(1)] if name.endswith("weight") else [Replicate()]


TRAINER_PLACEMENTS = {"columns_to_tp_and_full": columns}  # (other cases: FSDP2's own)


def case(rank: int, world: int, group, name: str, mode: str, transport: str) -> dict:
    """One case on the six ranks: the trainers (FSDP2 on their mesh) push VERSIONS versions, every gathering call
    refused meanwhile; each receiver pulls until it has the last, checking every element of each version it
    got; all meet at a barrier before closing."""
    from torch.distributed.fsdp import fully_shard

    m = meshes()
    trainers, mesh, receivers = CASES[name]
    out: dict = {"rank": rank}
    before = threads()
    if rank in trainers:
        if name in TRAINER_PLACEMENTS:
            td = expect_on(m[mesh], TRAINER_PLACEMENTS[name])
        else:
            net = model()
            fully_shard(net, mesh=m[mesh])
            td = TensorDict.from_module(net)
        set_version(td, 1)
        with cudarecv.ShardedSender(
            td, dst=sorted(receivers), mode=mode, transport=transport, verify=True, timeout=30
        ) as sender:
            saved: dict = {}
            no_gathers(saved)
            try:
                next(iter(td.values(True, True))).full_tensor()
            except AssertionError:
                out["gathers_refused"] = True
            try:
                for version in range(1, VERSIONS + 1):
                    set_version(td, version)
                    out.setdefault("pushed", []).append(sender.push())
            finally:
                restore(saved)
            out["plan"] = {
                r: [(n, b.starts, b.sizes) for n, b in p] for r, p in sender.plan.items()
            }
            out["transports"] = sender.transports
            dist.barrier()  # (latest mode: the receivers have the last version before the sender closes)
            closing = time.monotonic()
        out["close_s"] = round(
            time.monotonic() - closing, 2
        )  # (the sender's close(), for a failure's message)
        out["threads_left"] = threads() - before
        if out[
            "threads_left"
        ]:  # (what each receiver stood at, and where the threads are, for the failure's message)
            out["stacks"] = stacks(out["threads_left"])
            out["standings"] = [
                (m.rank, m.standing.value, m.why, m.failed)
                for _, s in sender._senders
                for m in s._s.members
            ]
        return out
    if rank not in receivers:
        dist.barrier()
        return out
    layout = receivers[rank]
    if layout is None:
        expect = None
    elif layout == "module":
        expect = model()
    else:
        expect = expect_on(m[layout[0]], layout[1])
    with cudarecv.ShardedReceiver(
        src=trainers, expect=expect, timeout=30, transport=transport
    ) as receiver:
        seen = []
        while not seen or seen[-1][0] < VERSIONS:
            version = receiver.pull()
            seen.append((version, holds(receiver.td, version)))
        out["seen"] = seen
        net = model()  # load_into: a module sharded as `expect` (its DTensor parameters' local shards), or whole
        if isinstance(expect, TensorDict):
            for key, t in expect.items(True, True):
                setattr(
                    net.get_submodule(key[0]),
                    key[1],
                    torch.nn.Parameter(t.clone(), requires_grad=False),
                )
        out["loaded"] = receiver.load_into(net) == VERSIONS and holds(
            TensorDict.from_module(net), VERSIONS
        )
        out["plan"] = {r: [(n, b.starts, b.sizes) for n, b in p] for r, p in receiver.plan.items()}
        out["transport"] = receiver.transport
        out["staged"] = receiver.staged_bytes
        dist.barrier()
    # (each sender rank's last words with it, for a failure's message: the receivers' threads, the senders')
    out["farewells"] = [(peer, r._inbox.farewell.state.value) for peer, _, r in receiver._inner]
    out["threads_left"] = threads() - before
    out["stacks"] = stacks(out["threads_left"])
    return out


@pytest.fixture(scope="module")
def six():
    ranks = Ranks(6, pg_timeout=60.0)
    yield ranks
    ranks.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name,mode,transport",
    [
        ("fsdp2_to_full_and_tp", "sync", "auto"),
        ("fsdp2_to_full_and_tp", "latest", "wire"),
        ("fsdp4_to_tp", "sync", "wire"),
        ("hsdp_to_full", "sync", "auto"),
        ("fsdp2_to_2d", "sync", "auto"),
        ("columns_to_tp_and_full", "sync", "wire"),
    ],
)
def test_sharded_trainers_push_every_element_once_into_any_layout(six, name, mode, transport):
    results = six().run(case, args=(name, mode, transport), timeout=300)
    trainers, _, receivers = CASES[name]
    for out in results:
        rank = out["rank"]
        assert not out.get("threads_left"), (
            f"rank {rank}: threads left after close() (which took {out.get('close_s')} s): {out['threads_left']}; "
            f"its receivers' standings "
            f"{out.get('standings')}; the receivers' farewells {[o.get('farewells') for o in results]}; where "
            f"the threads left are: {out.get('stacks')}"
        )
        if rank in trainers:
            assert out["pushed"] == list(range(1, VERSIONS + 1)), out
            assert out["gathers_refused"], "the pushes ran with gathering calls allowed"
        elif rank in receivers:
            versions = [v for v, _ in out["seen"]]
            assert all(ok for _, ok in out["seen"]), (
                f"rank {rank} got a wrong element: {out['seen']}"
            )
            assert out["loaded"], f"rank {rank}: load_into left the module without the last version"
            if mode == "sync":
                assert versions == list(range(1, VERSIONS + 1)), out["seen"]
            else:
                assert versions == sorted(set(versions)) and versions[-1] == VERSIONS, out["seen"]
            assert out["transport"] == ("wire" if transport == "wire" else "shared memory"), out
            # the pieces of this receiver, as the trainers planned them, are what it planned to get, and each
            # element of what it holds comes from one trainer once: the bytes it receives are its layout's
            planned = {t: sorted(results[t]["plan"][rank]) for t in trainers}
            assert planned == {t: sorted(out["plan"].get(t, [])) for t in trainers}, (
                planned,
                out["plan"],
            )
            # pieces land in place where they are one block of this receiver's layout: only column blocks of a
            # matrix cut by rows here (trainers cut by columns, into whole or row-cut weights) are staged, x 2 buffers
            strided = [
                (n, s)
                for t in trainers
                for n, _, s in out["plan"].get(t, [])
                if n.endswith("weight")
                and name in TRAINER_PLACEMENTS
                and _strided_here(name, rank, n)
            ]
            assert out["staged"] == 2 * sum(-(-_numel(s) * 8 // 16) * 16 for _, s in strided), (
                out["staged"],
                strided,
            )
    for receiver in receivers:
        got = sum(_numel(s) for t in trainers for _, _, s in results[t]["plan"][receiver])
        held_ = sum(torch.Size(s).numel() for s in _held_shapes(name, receiver))
        assert got == held_, f"rank {receiver} receives {got} elements, holds {held_}"


def _strided_here(name: str, rank: int, leaf: str) -> bool:
    """Whether a column block of ``leaf`` (a trainer cut by columns) lies strided in receiver ``rank``'s layout:
    whole weights, and the tensor-parallel pair's row-cut first layer."""
    layout = CASES[name][2][rank]
    return not isinstance(layout, tuple) or leaf == "0.weight"


def _numel(sizes) -> int:
    return torch.Size(sizes).numel()


def _held_shapes(name: str, rank: int) -> list[tuple[int, ...]]:
    """What receiver ``rank`` of case ``name`` holds of each leaf (torch's cut, computed without a mesh)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    layout = CASES[name][2][rank]
    if layout in (None, "module"):
        return list(SHAPES.values())
    ranks = {"r2": [[2, 3]], "r45": [[4, 5]], "r2d": [[2, 3], [4, 5]]}[layout[0]]
    coordinate = next([i, row.index(rank)] for i, row in enumerate(ranks) if rank in row)
    if len(ranks) == 1:
        coordinate = coordinate[1:]
    mesh_shape = (len(ranks), len(ranks[0])) if len(ranks) > 1 else (len(ranks[0]),)
    return [
        _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, layout[1](name))[0]
        for name, shape in SHAPES.items()
    ]


# -- the geometry, against torch's own cut ---------------------------------------------------------------


def _placements(draw, ndim: int, mesh_ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    return [
        draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(ndim)]))
        for _ in range(mesh_ndim)
    ]


@st.composite
def layouts(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = _placements(draw, ndim, len(mesh_shape)) if ndim else []
    if not ndim:
        from torch.distributed.tensor import Replicate

        placements = [Replicate()] * len(mesh_shape)
    return shape, mesh_shape, placements


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_boxes_are_torchs_cut_and_every_element_is_sent_once(layout):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, mesh_shape, placements = layout
    count = torch.zeros(shape, dtype=torch.int64)
    for coordinate in coordinates(mesh_shape):
        box = shard_box(shape, mesh_shape, placements, coordinate)
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), placements
        )
        assert box.sizes == tuple(local), (coordinate, box, local)
        if box.numel:
            assert box.starts == tuple(offset), (coordinate, box, offset)
        share = duty(shape, mesh_shape, placements, coordinate)
        if share is not None:
            assert share & box == share  # a rank sends only what it holds
            count[share.within(Box.full(shape))] += 1
    assert bool((count == 1).all()), count


def test_a_leafwise_version_lands_where_its_leaves_lie():
    """A sharded sender's pieces travel in messages cut leaf by leaf (the padding between leaves never sent), so a
    receiver lands each in its block of the wanted layout, stages only what would lie strided, and hashes what
    landed as the sender hashed what it sent."""
    from cudarecv.core.errors import SchemaError, UsageError
    from cudarecv.weights.schema import Schema
    from cudarecv.weights.slots import Slot
    from cudarecv.weights.wire import checksum

    keys = [("w",), ("steps",), ("none",)]
    tensors = [torch.arange(12.0).view(3, 4), torch.arange(5), torch.zeros(0)]
    schema = Schema.of(keys, tensors, leafwise=True)
    assert Schema.from_json(schema.to_json()) == schema
    assert (
        schema.fingerprint != Schema.of(keys, tensors).fingerprint
    )  # an even receiver refuses a leafwise push
    with pytest.raises(SchemaError, match="message cut"):
        Schema.from_json(schema.to_json().replace(b'"leaf"', b'"odd"'))
    storage = torch.zeros(schema.total, dtype=torch.uint8)  # the sender's snapshot
    for view, t in zip(schema.views(storage), tensors):
        view.copy_(t)
    messages = schema.cut(storage, 16)
    assert [m.numel() for m in messages] == schema.message_sizes(16) == [16, 16, 16, 16, 16, 8]
    whole = torch.full((6, 4), -1.0)  # the wanted layout: w lands in its first three rows
    slot = Slot.placed_at(schema, 16, torch.device("cpu"), False, [whole[:3], None, None])
    assert slot.storage.numel() == 48  # staged: only `steps` (40 bytes, aligned)
    for message, piece in zip(messages, slot.pieces):  # what the wire's receives do
        piece.copy_(message)
    assert torch.equal(whole[:3], tensors[0]) and (whole[3:] == -1).all()
    assert torch.equal(slot.td["steps"], tensors[1]) and slot.digest() == checksum(messages)
    refilled = torch.zeros(
        6, 4
    )  # a same-host snapshot, copied message by message where each leaf lies
    other = Slot.placed_at(schema, 16, torch.device("cpu"), False, [refilled[3:], None, None])
    other.fill(storage)
    assert torch.equal(refilled[3:], tensors[0]) and other.digest() == slot.digest()
    with pytest.raises(UsageError, match="strided"):
        Slot.placed_at(schema, 16, torch.device("cpu"), False, [torch.zeros(4, 3).t(), None, None])


def test_a_partial_leaf_is_refused_naming_it():
    from torch.distributed.tensor import Partial

    with pytest.raises(cudarecv.ArgumentError, match="leaf 'w' is placed Partial"):
        shard_box((4,), (2,), [Partial()], (0,), "leaf 'w'")


def strided_leaves(rank, world, group):
    """A plain weight sender of non-contiguous leaves (a transposed matrix, a column slice): each push copies them
    into its snapshot as they are; the receiver gets their values."""
    base = torch.arange(24.0).reshape(4, 6)
    td = TensorDict(t=base.t(), c=base[:, 1:3], whole=torch.ones(3))
    if rank == 0:
        with cudarecv.WeightSender(td, dst=1, timeout=30) as sender:
            sender.push()
            base.add_(100.0)
            sender.push()
        return None
    with cudarecv.WeightReceiver(src=0, expect=td, timeout=30) as receiver:
        got = []
        for version in (1, 2):
            receiver.pull()
            shifted = base + (100.0 if version == 2 else 0.0)
            got.append(
                torch.equal(receiver.td["t"], shifted.t())
                and torch.equal(receiver.td["c"], shifted[:, 1:3])
            )
        return got


def test_a_weight_sender_takes_strided_leaves(cluster):
    assert cluster().run(strided_leaves)[1] == [True, True]


WANTS = {
    1: {
        "0.weight": (slice(0, 4),),
        "2.weight": (slice(None), slice(3, 7)),
    },  # rows of one, columns of the other
    2: {"0.weight": (slice(4, 7),), "2.weight": (slice(None), slice(0, 3))},
    3: None,
}


def sliced(rank, world, group):
    """A plain trainer (one rank, a ``ShardedSender`` of plain tensors) pushes 3 versions; receivers 1 and 2 want slices of the two
    matrices (``want``), receiver 3 everything; each checks every element it holds of each version."""
    if rank == 0:
        td = TensorDict({name: whole(name, 1) for name in SHAPES}, []).unflatten_keys(".")
        with cudarecv.ShardedSender(td, dst=[1, 2, 3], verify=True, timeout=30) as sender:
            for version in (1, 2, 3):
                for name in SHAPES:
                    td[tuple(name.split("."))].copy_(whole(name, version))
                sender.push()
            plan = {r: sum(b.numel for _, b in pieces) for r, pieces in sender.plan.items()}
            dist.barrier()
        return plan
    if rank not in WANTS:
        dist.barrier()
        return None
    want = WANTS[rank]
    expect = model() if rank == 2 else None
    with cudarecv.ShardedReceiver(src=[0], expect=expect, want=want, timeout=30) as receiver:
        right, retired = [], None
        for version in (1, 2, 3):
            if (
                version == 3 and rank == 1
            ):  # as a failed relay forward does: rank 0's receiver renews its slot in
                index = (
                    receiver._slots.spare()
                )  # the spare buffer, which is then never written again
                retired = receiver._slots.own[index].storage
                kept, inner = retired.clone(), receiver._inner[0][2]
                inner._slots.renew(
                    index, inner.schema, inner._puller.bucket_bytes, torch.device("cpu")
                )
            assert receiver.pull() == version
            right.append(
                all(
                    torch.equal(
                        receiver.td[tuple(name.split("."))],
                        whole(name, version)[(want or {}).get(name, (slice(None),))],
                    )
                    for name in SHAPES
                )
            )
        staged = (
            0 if retired is None else receiver.staged_bytes
        )  # (rank 1: the renewed slot's own storage)
        untouched = retired is None or torch.equal(retired, kept)
        dist.barrier()
    return right, staged, untouched


def test_a_plain_trainer_sends_each_receiver_the_slices_it_wants(six):
    """``ShardedSender`` of plain tensors and ``ShardedReceiver(want=...)``: each receiver gets exactly its slices (rows,
    or columns taken whole along their rows: no staging), the others' leaves whole; a sender rank's receiver that
    renews a slot (a relay forward of it failed) has its buffer replaced, never written again."""
    results = six().run(sliced, timeout=300)
    assert results[2] == results[3] == ([True, True, True], 0, True), results[2:4]
    # rank 1: its old buffer untouched, every version right, and the renewed slot's own storage staged: its pieces,
    # 4 x 5 + 7 + 3 x 4 + 3 float64 (160 + 64 + 96 + 32 bytes, each aligned to 16)
    assert results[1] == ([True, True, True], 352, True), results[1]
    biases = 7 + 3
    assert results[0] == {
        1: 4 * 5 + 3 * 4 + biases,
        2: 3 * 5 + 3 * 3 + biases,
        3: 7 * 5 + 3 * 7 + biases,
    }


def test_want_is_checked_naming_the_leaf():
    from cudarecv.weights.sharded.layout import narrowed, wanting_all

    layout = wanting_all(
        cudarecv.weights.sharded.layout.sender_layout(
            [("w",), ("b",)], [torch.zeros(4, 6), torch.zeros(4)]
        )
    )
    assert narrowed(layout, {"w": (slice(1, 3), slice(2, None))}, set()).parts[0].box == Box(
        (1, 2), (2, 4)
    )
    assert narrowed(layout, {"w": [slice(1, 3)]}, set()).parts[0].box == Box(
        (1, 0), (2, 6)
    )  # (a list, one slice)
    assert narrowed(layout, {"w": slice(0, 4)}, set()).parts[0].box == Box(
        (0, 0), (4, 6)
    )  # (a slice alone)
    assert narrowed(layout, {"w": (slice(0, 4, 1),)}, set()).parts[0].box == Box((0, 0), (4, 6))
    for want, match in [
        ({"x": (slice(0, 1),)}, "'x', which the sender does not send"),
        ({"w": (slice(3, 3),)}, "empty"),
        ({"w": (slice(4, None),)}, "empty"),
        ({"w": (slice(0, 4, 2),)}, "step-1 slices"),
        ({"b": (slice(0, 1),) * 2}, "up to 1"),
        ({"w": (slice(-2, None),)}, "negative bound -2: count from the start"),
        ({"w": (slice(0, -1),)}, "negative bound -1"),
        ({"w": (slice(0, 5),)}, "reaches past dimension 0 of the leaf, of size 4"),
        ({"w": (slice(None), slice(2, 7))}, "reaches past dimension 1 of the leaf, of size 6"),
        ({"w": (slice(9, 12),)}, "reaches past dimension 0"),
    ]:
        with pytest.raises(cudarecv.ArgumentError, match=match):
            narrowed(layout, want, set())
    for want, match in [
        ({"w": (slice(0, 2.5),)}, r"bound 2\.5 \(float\): bounds are ints or None"),
        ({"w": (slice("0", 2),)}, r"bound '0' \(str\)"),
        ({"w": (slice(True, 2),)}, "bound True"),
        ({"w": (slice(0, 4, 1.0),)}, r"step 1.0 \(float\)"),
        ({"w": (0,)}, r"holds 0 \(int\), not a slice \(index 0 alone is slice\(0, 1\)\)"),
        ({"w": ((0, 2),)}, r"holds \(0, 2\) \(tuple\), not a slice"),
        ({"w": (Ellipsis,)}, "not a slice"),
        ({"w": None}, "holds None"),
        ({("w",): (slice(0, 1),)}, "as a string"),
        ({3: (slice(0, 1),)}, "names leaf 3"),
        ([("w", (slice(0, 1),))], "`want` must be a dict, got list"),
        ("w", "got str"),
    ]:
        with pytest.raises(cudarecv.ArgumentTypeError, match=match) as raised:
            narrowed(layout, want, set())
        assert "`want" in str(raised.value) and 'e.g. {"up.weight": (slice(0, 512),)' in str(
            raised.value
        )
    with pytest.raises(cudarecv.ArgumentError, match="gives as a DTensor"):
        narrowed(layout, {"w": (slice(0, 1),)}, {0})


BAD_WANTS = [
    ({"w": (slice(0, 2.5),)}, "ArgumentTypeError", "bound 2.5 (float)"),
    ({"w": (slice(0, 4, 2),)}, "ArgumentError", "step 2"),
    ({"w": (slice(0, 5),)}, "ArgumentError", "reaches past dimension 0 of the leaf, of size 4"),
    ([("w", slice(0, 1))], "ArgumentTypeError", "`want` must be a dict"),
]


def bad_wants(rank, world, group):
    """A sliced sender on rank 0; rank 1 builds a receiver with each malformed ``want`` in turn: it raises the
    cudarecv error naming ``want``, and the sender is told at once (ReceiverFailed), the link left in step."""
    out = []
    for want, _, _ in BAD_WANTS:
        try:
            if rank == 0:
                cudarecv.ShardedSender(TensorDict(w=torch.zeros(4, 6)), dst=[1], timeout=20)
            else:
                cudarecv.ShardedReceiver(src=[0], want=want, timeout=20)
            out.append(None)
        except Exception as error:  # noqa: BLE001 - what each side raised is the result
            out.append((type(error).__name__, str(error)))
    return out


def test_a_malformed_want_raises_a_cudarecv_error_on_the_receiver_and_tells_the_sender(cluster):
    results = cluster().run(bad_wants, timeout=120)
    for (want, kind, text), sent, got in zip(BAD_WANTS, results[0], results[1]):
        assert got is not None and got[0] == kind and text in got[1] and "`want" in got[1], (
            want,
            got,
        )
        assert sent is not None and sent[0] == "ReceiverFailed" and text in sent[1], (want, sent)


# -- failures, refusals and closing ---------------------------------------------------------------------


def dead_trainer(rank, world, group, transport, how):
    """Trainers 0 and 1 (FSDP2) push to a tensor-parallel pair (ranks 2, 3); trainer 1 is SIGKILLed (or SIGSTOPped)
    once version 2 is everywhere; rank 0 pushes version 3. Each receiver's pull of version 3 must raise naming
    rank 1, publish nothing of it, and keep version 2 whole (a stopped rank 1 is killed once both have checked)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    trainers, pair = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    if rank < 2:
        net = model()
        fully_shard(net, mesh=trainers)
        td = TensorDict.from_module(net)
        with cudarecv.ShardedSender(td, dst=[2, 3], transport=transport, timeout=30) as sender:
            for version in (1, 2):
                set_version(td, version)
                sender.push()
            if rank == 1:
                if how == "stop":
                    store().set("stopped_trainer", str(os.getpid()))
                stop_here(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            set_version(td, 3)
            sender.push()  # (rank 0's pieces: the receivers take them, then wait for rank 1's)
            store().set("pushed_3", "1")
            return sender.version
    with cudarecv.ShardedReceiver(
        src=[0, 1], expect=expect_on(pair, tensor_parallel), timeout=30, transport=transport
    ) as receiver:
        for version in (1, 2):
            assert receiver.pull() == version and holds(receiver.td, version)
        signals, outcome = store(), None
        while outcome is None:
            # a stopped rank 1: pull until a pull began after rank 0's pieces of version 3 were all taken (its push
            # returned), so that rank 1 is the one silent rank whatever the machine's speed
            pushed = how == "kill" or signals.check(["pushed_3"])
            try:
                receiver.pull(timeout=20 if how == "kill" else 3)
                outcome = ("pulled version 3",)
            except (cudarecv.PeerError, cudarecv.TransferTimeout, cudarecv.WaitTimeout) as error:
                if pushed:
                    outcome = (
                        type(error).__name__,
                        str(error),
                        receiver.version,
                        holds(receiver.td, 2),
                    )
        if how == "stop":
            signals.set(f"checked_{rank}", "1")
            if rank == 2:
                signals.wait(["checked_2", "checked_3"])
                os.kill(int(signals.get("stopped_trainer")), signal.SIGKILL)
        return outcome


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport,how", [("auto", "kill"), ("wire", "kill"), ("auto", "stop")])
def test_a_dead_or_stopped_trainer_rank_is_named_and_no_receiver_publishes_a_mix(transport, how):
    with Cluster(4) as ranks:
        results = ranks.run(dead_trainer, args=(transport, how), timeout=200, may_die=[1])
    assert results[0] == 3
    for rank in (2, 3):
        kind, message, version, whole = results[rank]
        if how == "kill":
            assert kind == "PeerError" and "link to rank 1 of the group failed" in message, results[
                rank
            ]
        else:  # nothing of version 3 came from rank 1: the pull names it and goes on (a stalled rank)
            assert (
                kind == "WaitTimeout" and "from rank(s) [1] no version newer than 2" in message
            ), results[rank]
        assert version == 2 and whole, results[rank]


def refusals(rank, world, group):
    """A receiver that names only one of the two trainer ranks as `src` is refused (its pieces would not fill what it
    wants), on both ends; a Partial leaf is refused before anything is sent."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    trainers = DeviceMesh("cpu", [0, 1])
    out = []
    if rank < 2:
        net = model()
        fully_shard(net, mesh=trainers)
        try:  # (rank 1 is never answered: it waits 1 s for that, rank 0 up to 5 s for its refusal)
            cudarecv.ShardedSender(
                TensorDict.from_module(net), dst=[2], timeout=5 if rank == 0 else 1
            )
        except cudarecv.Error as error:
            out.append((type(error).__name__, str(error)))
        partial = DTensor.from_local(torch.zeros(4), trainers, [Partial()], run_check=False)
        try:
            cudarecv.ShardedSender(TensorDict(w=partial), dst=[2], timeout=5)
        except cudarecv.Error as error:
            out.append((type(error).__name__, str(error)))
        return out
    if rank == 2:
        try:
            cudarecv.ShardedReceiver(src=[0], timeout=5)
        except cudarecv.Error as error:
            out.append((type(error).__name__, str(error)))
    return out


def test_a_receiver_missing_a_trainer_rank_and_a_partial_leaf_are_refused(six):
    try:
        results = six().run(refusals, timeout=120)
    finally:
        six().close()  # rank 1's layout, never read, is still on its link to rank 2: the next test needs new groups
    kind, message = results[2][0]
    assert kind == "SchemaError" and "pass every rank of the sender's mesh as `src`" in message, (
        results[2]
    )
    assert (
        results[0][0][0] == "SchemaError"
        and "receiver rank 2 rejected the weights" in results[0][0][1]
    ), results[0]
    assert results[1][0][0] == "TransferTimeout" and "rank 2" in results[1][0][1], results[
        1
    ]  # (never asked)
    for trainer in (0, 1):
        assert (
            results[trainer][1][0] == "ArgumentError"
            and "leaf 'w' is placed Partial" in results[trainer][1][1]
        )


def closing(rank, world, group):
    """Receiver 4 closes after version 1: the trainers' next push goes on to the tensor-parallel pair; then the
    trainers close, and the pair's next pull raises SenderClosed with version 2 still readable."""
    from torch.distributed.fsdp import fully_shard

    m = meshes()
    if rank < 2:
        net = model()
        fully_shard(net, mesh=m["t2"])
        td = TensorDict.from_module(net)
        sender = cudarecv.ShardedSender(td, dst=[2, 3, 4], timeout=30)
        set_version(td, 1)
        sender.push()
        dist.barrier()  # (receiver 4 has closed)
        set_version(td, 2)
        sender.push()
        dropped = sender.dropped
        sender.close()
        dist.barrier()
        return dropped
    if rank == 5:
        dist.barrier()
        dist.barrier()
        return None
    expect = model() if rank == 4 else expect_on(m["r2"], tensor_parallel)
    receiver = cudarecv.ShardedReceiver(src=[0, 1], expect=expect, timeout=30)
    receiver.pull()
    if rank == 4:
        receiver.close()
        dist.barrier()
        dist.barrier()
        return holds(receiver.td, 1)
    dist.barrier()
    receiver.pull()
    dist.barrier()
    try:
        receiver.pull(timeout=20)
        outcome = "pulled"
    except cudarecv.SenderClosed:
        outcome = "SenderClosed"
    receiver.close()
    return outcome, receiver.version, holds(receiver.td, 2)


def test_closing_both_ways(six):
    results = six().run(closing, timeout=120)
    for trainer in (0, 1):
        assert results[trainer] == {4: "closed by its receiver"}, results[trainer]
    assert results[4] is True
    for rank in (2, 3):
        assert results[rank] == ("SenderClosed", 2, True), results[rank]
