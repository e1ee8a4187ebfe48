"""The native fast wire: buckets and chunks, the checked header, drain on mismatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.plan import header as _header
from rawwire import unique_key
from tdfactory import STRUCTURES, make, same


def _peer(rank, group):
    if group is None:
        return (1 - rank,), {}
    return (), {"group": group, ("group_dst" if rank == 0 else "group_src"): 1 - rank}


def roundtrip(rank, world, group, bucket_bytes, recv_bucket_bytes, consolidated, blocking):
    args, peer = _peer(rank, group)
    sending = rank == 0
    ok = {}
    for structure in STRUCTURES:
        td = make(structure, 5.0 if sending else 0.0)
        if consolidated:
            td = td.consolidate(metadata=True)
        for step in range(3):  # repeated transfers reuse the cached plan and staging
            if sending:
                td = make(structure, 5.0 + step)
                if consolidated:
                    td = td.consolidate(metadata=True)
            kw = {**peer, "consolidated": consolidated,
                  "bucket_bytes": bucket_bytes if sending else recv_bucket_bytes}
            if blocking:
                (cudarecv.send if sending else cudarecv.recv)(td, *args, **kw)
            elif sending:
                [h] = cudarecv.isend(td, *args, **kw, return_early=True)
                assert h.wait(timeout=10) is None
            else:
                [h] = cudarecv.irecv(td, *args, **kw, return_premature=True)
                assert h.wait(timeout=10) is td
            if not sending:
                ok[(structure, step)] = same(td, make(structure, 5.0 + step))
    return ok


@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("bucket_bytes,recv_bucket_bytes", [(7, 7), (64, 1 << 20), (1 << 20, 8)])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
def test_roundtrip(cluster, bucket_bytes, recv_bucket_bytes, consolidated, blocking, standalone):
    _, ok = cluster().run(roundtrip, args=(bucket_bytes, recv_bucket_bytes, consolidated, blocking),
                          standalone=standalone)
    assert ok and all(ok.values()), [k for k, v in ok.items() if not v]


def big_leaves(rank, world, group):
    """Leaves much larger than a bucket span several messages; a leaf smaller than one shares it."""
    td = TensorDict(big=torch.full((300_000,), float(rank)), small=torch.full((3,), float(rank) + 1),
                    mid=torch.arange(5000, dtype=torch.float64) * (rank + 1))
    if rank == 0:
        td["big"] = torch.arange(300_000, dtype=torch.float32)
        cudarecv.send(td, 1, bucket_bytes=100_000, pseudo_rand=True, init_tag=9)
        return None
    cudarecv.recv(td, 0, bucket_bytes=100_000, pseudo_rand=True, init_tag=9)
    return (torch.equal(td["big"], torch.arange(300_000, dtype=torch.float32)),
            td["small"].tolist(), td["mid"][:3].tolist())


def test_leaves_split_across_buckets(cluster):
    _, (big_ok, small, mid) = cluster().run(big_leaves)
    assert big_ok and small == [1.0, 1.0, 1.0] and mid == [0.0, 1.0, 2.0]


def mismatch_then_ok(rank, world, group, kind):
    """A mismatched receive raises, leaves the tensordict untouched, and the link still works."""
    consolidated = kind.startswith("chunks")
    good = make("nested", 3.0 if rank == 0 else 0.0)
    if kind == "buckets-shape":
        bad_sender = good.clone()
        bad_sender["b"] = torch.zeros(6)  # other shape, other byte count
    elif kind == "buckets-dtype":
        bad_sender = good.clone()
        bad_sender["b"] = good["b"].to(torch.int32)  # same byte count, other dtype
    elif kind == "buckets-key":
        bad_sender = good.clone()
        bad_sender.rename_key_("b", "bb")  # same bytes, other key
    elif kind == "chunks-layout":
        bad_sender = make("flat", 3.0)
    elif kind == "chunks-vs-buckets":
        bad_sender = good.clone()
    if consolidated:
        good = good.consolidate(metadata=True)
        if kind == "chunks-layout":
            bad_sender = bad_sender.consolidate(metadata=True)
    sender_consolidated = consolidated and kind != "chunks-vs-buckets"
    if rank == 0:
        cudarecv.send(bad_sender, 1, bucket_bytes=16, consolidated=sender_consolidated)
        cudarecv.send(good, 1, bucket_bytes=16, consolidated=consolidated)
        return None
    before = good.clone()
    try:
        cudarecv.recv(good, 0, bucket_bytes=32, consolidated=consolidated)
    except cudarecv.HeaderError as error:
        message = str(error)
    else:
        message = None
    untouched = same(good, before)
    cudarecv.recv(good, 0, bucket_bytes=32, consolidated=consolidated)
    return message, untouched, same(good, make("nested", 3.0))


@pytest.mark.parametrize("kind", ["buckets-shape", "buckets-dtype", "buckets-key", "chunks-layout",
                                  "chunks-vs-buckets"])
def test_mismatch_is_rejected_drained_and_link_survives(cluster, kind):
    _, (message, untouched, next_ok) = cluster().run(mismatch_then_ok, args=(kind,))
    assert message is not None and "drained" in message and "untouched" in message
    assert untouched, "the tensordict was written despite the mismatch"
    assert next_ok, "the next transfer on the same link failed"


def test_header_roundtrip_and_corruption():
    h = _header.Header(_header.KIND_BUCKETS, 3, 1000, 64, bytes(range(16)))
    raw = h.pack()
    assert len(raw) == _header.SIZE and _header.Header.unpack(raw) == h
    assert _header.piece_sizes(h.total, h.piece) == [64] * 15 + [40]
    corrupted = bytearray(raw)
    corrupted[20] ^= 1
    with pytest.raises(cudarecv.OutOfStepError, match="not a cudarecv header"):
        _header.Header.unpack(bytes(corrupted))
    with pytest.raises(cudarecv.OutOfStepError, match="not a cudarecv header"):
        _header.Header.unpack(bytes(64))


@pytest.mark.parametrize("transport,slots", [(1, 2), (2, _header.STORAGE_SLOTS), (3, 1), (4, 2)],
                         ids=["segment", "storage", "direct", "device_segment"])
def test_header_routes_name_only_segments_and_storage_slots_that_exist(transport, slots):
    h = _header.Header(_header.KIND_CHUNKS, 3, 1000, 64, bytes(16), transport=transport, offer=True, seq=5)
    for k in range(slots):
        same = dataclasses.replace(h, segment=k)
        assert _header.Header.unpack(same.pack()) == same
    with pytest.raises(cudarecv.OutOfStepError, match="unknown payload route"):
        _header.Header.unpack(dataclasses.replace(h, segment=slots).pack())
    with pytest.raises(cudarecv.OutOfStepError, match="unknown payload route"):
        _header.Header.unpack(dataclasses.replace(h, transport=5).pack())


def test_schema_digest_sees_keys_dtypes_shapes_offsets():
    from cudarecv.plan.walk import walk

    base = walk(make("flat", 0.0))
    digest = _header.schema_digest(*base)
    assert digest == _header.schema_digest(*walk(make("flat", 9.0)))  # values do not matter
    other = make("flat", 0.0)
    other["z"] = torch.zeros(3, dtype=torch.int32)
    assert _header.schema_digest(*walk(other)) != digest
    assert _header.schema_digest(*base, offsets=[0, 8, 16], storage_bytes=64) != digest


# -- what a buggy or hostile sender can put on the wire -----------------------------------

HEADER_TAG_0 = 1 << 30  # the fast wire's header tag for init_tag=0

LYING = {"2e7_bytes_in_1_byte_pieces": (20_000_000, 1), "1e15_bytes": (10**15, 1),
         "1e15_bytes_in_one_piece": (10**15, 10**15), "2e7_bytes_in_one_piece": (20_000_000, 20_000_000)}


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def lying_headers(rank, world, group, cases):
    import time

    from cudarecv.plan.plan import plan_for
    from rawwire import raw_send

    td = make("nested", float(rank))
    if rank == 0:
        plan = plan_for(td)
        for case in cases:
            total, piece = LYING[case]
            lie = _header.Header(_header.KIND_BUCKETS, len(plan.tensors), total, piece, plan.bucket_header.schema)
            raw_send(group, 1, lie.pack(), HEADER_TAG_0)
        return None
    out = []
    for _ in cases:
        td = make("nested", 0.0)  # a tensordict that met a lie is refused on this link afterwards
        before, started = _rss(), time.monotonic()
        try:
            cudarecv.recv(td, 0, bucket_bytes=64)
            outcome = "accepted"
        except cudarecv.OutOfStepError as error:
            outcome = str(error)
        except BaseException as error:  # noqa: BLE001 - anything else is the defect
            outcome = f"{type(error).__name__}: {error}"
        out.append((outcome, time.monotonic() - started, _rss() - before))
    try:
        cudarecv.recv(td, 0, bucket_bytes=64)
        refused = "accepted"
    except cudarecv.LinkError as error:
        refused = str(error)
    return out, refused


def test_a_header_lying_about_lengths_is_refused_before_anything_is_sized(cluster):
    cases = list(LYING)
    try:
        results, refused = cluster().run(lying_headers, args=(cases,), timeout=90)[1]
    finally:
        cluster().close()
    assert "an earlier transfer of this tensordict" in refused, refused
    for case, (outcome, took, grown) in zip(cases, results):
        assert "not drained" in outcome and "out of step" in outcome, f"{case}: {outcome}"
        # refused at once: the defect blocked draining until the group timeout (20 s)
        assert took < 15 and grown < 32 << 20, f"{case}: {took:.1f} s, +{grown / 2**20:.0f} MiB"


def oversize_header(rank, world, group):
    from cudarecv.plan.plan import plan_for
    from rawwire import raw_send

    td = make("nested", float(rank))
    if rank == 0:
        header = plan_for(td).bucket_header.for_transfer(64, 0)
        raw_send(group, 1, header.pack() + b"\x01" * 40, HEADER_TAG_0)  # a valid header, then more
        return None
    try:
        cudarecv.recv(td, 0, bucket_bytes=64)
    except cudarecv.OutOfStepError as error:
        return str(error)
    return "accepted"


def test_an_oversize_header_is_a_header_error(cluster):
    try:
        message = cluster().run(oversize_header)[1]
    finally:
        cluster().close()
    assert "longer than" in message, message


def drain_timeout(rank, world, group, key):
    """A valid header of another tensordict, then no payload: the receiver's drain times out. The receive
    starts once the header is posted (its 1 s clock does not run while the sender's rank starts)."""
    from datetime import timedelta

    from cudarecv.plan.plan import plan_for
    from rawwire import _pg, store

    if rank == 0:
        header = plan_for(make("nested", 1.0)).bucket_header.for_transfer(64, 0).pack()
        work = _pg(group).send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], 1, HEADER_TAG_0)
        store().set(key, "posted")
        work.wait(timedelta(seconds=20))
        return None
    store().wait([key], timedelta(seconds=30))
    try:
        cudarecv.recv(make("flat", 0.0), 0, bucket_bytes=64, timeout=1.0)
    except cudarecv.TransferTimeout as error:
        return str(error), getattr(error.__cause__, "stage", None)
    return "accepted", None


def test_a_timeout_while_draining_names_the_drain(cluster):
    try:
        message, stage = cluster().run(drain_timeout, args=(unique_key("drain"),))[1]
    finally:
        cluster().close()  # the drain's receive stays posted
    assert stage is not None and stage.startswith("drain of a mismatched fast-wire payload"), (message, stage)
    assert message.startswith(f"{stage}: rank 0 did not answer within 1 s (it began this transfer"), message
    assert "fast-wire mismatch" in stage and "bytes on tag" in stage, stage


def two_in_flight(rank, world, group, order, consolidated, init_tags):
    """Two fast-wire transfers in flight on one link at once, with other bucket sizes."""
    a, b = make("nested", 1.0 if rank == 0 else 0.0), make("flat", 2.0 if rank == 0 else 0.0)
    if consolidated:
        a, b = a.consolidate(metadata=True), b.consolidate(metadata=True)
    kw = {"consolidated": consolidated}
    if rank == 0:
        [ta] = cudarecv.isend(a, 1, init_tag=init_tags[0], bucket_bytes=8, return_early=True, **kw)
        [tb] = cudarecv.isend(b, 1, init_tag=init_tags[1], bucket_bytes=24, return_early=True, **kw)
        ta.wait(20), tb.wait(20)
        return None
    [ta] = cudarecv.irecv(a, 0, init_tag=init_tags[0], bucket_bytes=1, return_premature=True, **kw)
    [tb] = cudarecv.irecv(b, 0, init_tag=init_tags[1], bucket_bytes=1, return_premature=True, **kw)
    for t in ((ta, tb) if order == "in_order" else (tb, ta)):
        t.wait(20)
    return same(a, make("nested", 1.0)), same(b, make("flat", 2.0))


@pytest.mark.parametrize("init_tags", [(0, 1), (1, 0), (5, 6)], ids=str)
@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_two_transfers_in_flight_with_neighbouring_init_tags(cluster, order, consolidated, init_tags):
    _, ok = cluster().run(two_in_flight, args=(order, consolidated, init_tags))
    assert ok == (True, True)
