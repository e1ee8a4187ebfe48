"""The native fast wire: buckets and chunks, the checked header, drain on mismatch."""

from __future__ import annotations

import dataclasses
import re

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
            kw = {
                **peer,
                "consolidated": consolidated,
                "bucket_bytes": bucket_bytes if sending else recv_bucket_bytes,
            }
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
    _, ok = cluster().run(
        roundtrip,
        args=(bucket_bytes, recv_bucket_bytes, consolidated, blocking),
        standalone=standalone,
    )
    assert ok and all(ok.values()), [k for k, v in ok.items() if not v]


def big_leaves(rank, world, group):
    """Leaves much larger than a bucket span several messages; a leaf smaller than one shares it."""
    td = TensorDict(
        big=torch.full((300_000,), float(rank)),
        small=torch.full((3,), float(rank) + 1),
        mid=torch.arange(5000, dtype=torch.float64) * (rank + 1),
    )
    if rank == 0:
        td["big"] = torch.arange(300_000, dtype=torch.float32)
        cudarecv.send(td, 1, bucket_bytes=100_000, pseudo_rand=True, init_tag=9)
        return None
    cudarecv.recv(td, 0, bucket_bytes=100_000, pseudo_rand=True, init_tag=9)
    return (
        torch.equal(td["big"], torch.arange(300_000, dtype=torch.float32)),
        td["small"].tolist(),
        td["mid"][:3].tolist(),
    )


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


@pytest.mark.parametrize(
    "kind", ["buckets-shape", "buckets-dtype", "buckets-key", "chunks-layout", "chunks-vs-buckets"]
)
def test_mismatch_is_rejected_drained_and_link_survives(cluster, kind):
    _, (message, untouched, next_ok) = cluster().run(mismatch_then_ok, args=(kind,))
    assert message is not None and "drained" in message and "untouched" in message
    assert untouched, "the tensordict was written despite the mismatch"
    assert next_ok, "the next transfer on the same link failed"


def test_header_roundtrip_and_corruption():
    h = _header.Header(_header.KIND_BUCKETS, 3, 1000, 64, bytes(range(16)))
    raw = h.pack()
    assert len(raw) == _header.SIZE and _header.Header.unpack(raw) == h
    assert _header.piece_sizes(h.total, h.bucket_bytes) == [64] * 15 + [40]
    corrupted = bytearray(raw)
    corrupted[20] ^= 1
    with pytest.raises(cudarecv.OutOfStepError, match="not a cudarecv header"):
        _header.Header.unpack(bytes(corrupted))
    with pytest.raises(cudarecv.OutOfStepError, match="not a cudarecv header"):
        _header.Header.unpack(bytes(64))


@pytest.mark.parametrize(
    "transport,slots",
    [(1, 2), (2, _header.STORAGE_SLOTS), (3, 1), (4, 2)],
    ids=["segment", "storage", "direct", "device_segment"],
)
def test_header_routes_name_only_segments_and_storage_slots_that_exist(transport, slots):
    h = _header.Header(
        _header.KIND_CHUNKS, 3, 1000, 64, bytes(16), transport=transport, offer=True, seq=5
    )
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

LYING = {
    "2e7_bytes_in_1_byte_pieces": (20_000_000, 1),
    "1e15_bytes": (10**15, 1),
    "1e15_bytes_in_one_piece": (10**15, 10**15),
    "2e7_bytes_in_one_piece": (20_000_000, 20_000_000),
}


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
            lie = _header.Header(
                _header.KIND_BUCKETS, len(plan.tensors), total, piece, plan.bucket_header.schema
            )
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
        work = _pg(group).send(
            [torch.frombuffer(bytearray(header), dtype=torch.uint8)], 1, HEADER_TAG_0
        )
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
    assert stage is not None and stage.startswith("drain of a mismatched fast-wire payload"), (
        message,
        stage,
    )
    assert message.startswith(
        f"{stage}: rank 0 did not answer within 1 s (it began this transfer"
    ), message
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
    for t in (ta, tb) if order == "in_order" else (tb, ta):
        t.wait(20)
    return same(a, make("nested", 1.0)), same(b, make("flat", 2.0))


@pytest.mark.parametrize("init_tags", [(0, 1), (1, 0), (5, 6)], ids=str)
@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_two_transfers_in_flight_with_neighbouring_init_tags(
    cluster, order, consolidated, init_tags
):
    _, ok = cluster().run(two_in_flight, args=(order, consolidated, init_tags))
    assert ok == (True, True)


def dies_mid_payload(rank, world, group, key, consolidated):
    """The sender's payload is 4 messages; it sends the first 2, waits until the receiver has taken them (the
    receiver says so through the store once its second message has landed), then SIGKILLs itself before the
    rest goes: the receiver's failure names the payload and the message it waited for, not the header."""
    import os
    import signal

    from cudarecv.core.tags import piece_tag
    from cudarecv.plan.plan import Plan
    from cudarecv.wire import fast
    from cudarecv.wire import staging as _staging
    from rawwire import set_flag, wait_flag

    td = TensorDict(x=torch.zeros(4 << 10))  # 16 KiB: 4 messages of 4 KiB
    if consolidated:
        td = td.consolidate(metadata=True)
    kw = dict(bucket_bytes=4 << 10, consolidated=consolidated, transport="wire", timeout=60)
    if rank == 0:
        send_from = fast.send_from

        def two_then_die(lane, srcs, tags, staging=None, defer=False):
            if list(tags[:1]) == [piece_tag(0)] and len(srcs) == 4:
                yield from send_from(
                    lane, srcs[:2], tags[:2]
                )  # they complete once the receiver took them
                wait_flag(f"{key}_two_in")
                os.kill(os.getpid(), signal.SIGKILL)
            return (yield from send_from(lane, srcs, tags, staging, defer))

        fast.send_from = two_then_die
        cudarecv.send(td, 1, **kw)
        return None
    told = []

    def say(i: int) -> None:
        if i == 1 and not told:
            told.append(i)
            set_flag(f"{key}_two_in")

    if consolidated:  # (chunks land straight in the storage: the receive's own progress says when)
        recv_into = _staging.recv_into

        def counting(lane, dests, tags, staging=None, landed=None):
            def seen(i):
                landed(i)
                say(i)

            return (yield from recv_into(lane, dests, tags, staging, seen if landed else None))

        fast.recv_into = counting
    else:
        unpack = Plan.unpack

        def unpacking(plan, piece, index, place="cpu"):
            unpack(plan, piece, index, place)
            say(index)

        Plan.unpack = unpacking
    with pytest.raises(cudarecv.LinkError) as error:
        cudarecv.recv(td, 0, **kw)
    return type(error.value).__name__, str(error.value)


@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
def test_a_sender_killed_mid_payload_is_named_at_its_payload(consolidated):
    from cudarecv.testing.launch import Cluster, RankExit

    with Cluster(
        2, pg_timeout=30.0
    ) as ranks:  # (new ranks: the sender dies, the patches die with them)
        results = ranks.run(
            dies_mid_payload,
            args=(unique_key("mid_payload"), consolidated),
            may_die={0},
            timeout=120,
        )
    assert isinstance(results[0], RankExit)
    kind, message = results[1]
    what = "chunk" if consolidated else "bucket"
    # before: "receive of the fast-wire header (tag 1073741824): the link to rank 0 failed after ..."
    assert kind == "PeerError" and "fast-wire header" not in message, message
    assert message.startswith(
        f"receive of the fast-wire payload, {what} 3 of 4 (2 in; 4096 bytes each on tag "
        f"{1 << 30 | 1 << 28}): the link to rank 0 failed"
    ), message


def _changed(td, case):
    """The sender's side of a mismatch ``case``: ``td`` with one key changed, missing or added."""
    bad = td.clone()
    if case == "shape":
        bad["b"] = torch.zeros(6)
    elif case == "dtype":
        bad["b"] = td["b"].to(torch.int32)  # the same bytes, another dtype
    elif case == "missing":
        del bad["c"]
    elif case == "extra":
        bad["d"] = torch.zeros(2)
    return bad


def mismatch_names_the_key(rank, world, group, key, case, consolidated, transport):
    """On a new group the sender sends a mismatched tensordict twice (the first time with its layout, the second
    without: the receiver kept it), then the right one; the receiver's errors name the key that differs."""
    from datetime import timedelta

    import torch.distributed as dist

    from rawwire import store

    pg = dist.ProcessGroupGloo(dist.PrefixStore(key, store()), rank, world, timedelta(seconds=30))
    peer = {"group": pg, ("group_dst" if rank == 0 else "group_src"): 1 - rank}
    good = make("nested", 3.0 if rank == 0 else 0.0)
    bad = _changed(good, case)
    if consolidated:
        good, bad = good.consolidate(metadata=True), bad.consolidate(metadata=True)
    kw = dict(peer, bucket_bytes=16, consolidated=consolidated, transport=transport, timeout=30)
    if rank == 0:
        for td in (bad, bad, good):
            cudarecv.send(td, **kw)
        return None
    messages = []
    for _ in range(2):
        with pytest.raises(cudarecv.HeaderError) as error:
            cudarecv.recv(good, **kw)
        messages.append(str(error.value))
    cudarecv.recv(good, **kw)
    return messages, same(good, make("nested", 3.0))


MISMATCHES = {
    "shape": "at key 'b' differs in shape: the sender sends shape [6] float32 (24 bytes); this tensordict has "
    "shape [4] float32 (16 bytes)",
    "dtype": "at key 'b' differs in dtype: the sender sends shape [4] int32 (16 bytes); this tensordict has "
    "shape [4] float32 (16 bytes)",
    "missing": "at key 'c': this tensordict has it (shape [2] float64 (16 bytes)); the sender sends no such key",
    "extra": "at key 'd': the sender sends it (shape [2] float32 (8 bytes)); this tensordict has no such key",
}


@pytest.mark.parametrize("transport", ["wire", "auto"])
@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_mismatch_names_the_first_key_that_differs_on_both_sides(
    cluster, case, consolidated, transport
):
    _, (messages, ok) = cluster().run(
        mismatch_names_the_key, args=(unique_key("names"), case, consolidated, transport)
    )
    assert ok, "the next transfer on the link failed"
    for (
        message
    ) in messages:  # the first with the layout that came with it, the second with the one kept
        # before: "fast-wire mismatch: the sender sends buckets (non-consolidated) of 5 leaves, 60 bytes, schema
        # 3f1c...; this tensordict expects buckets (non-consolidated) of 5 leaves, 52 bytes, schema 9a0e..."
        said = re.sub(
            r" at byte \d+ of the storage", "", message
        )  # (consolidated: where each leaf lies, too)
        assert said.startswith(f"fast-wire mismatch {MISMATCHES[case]}"), message
        assert "drained and the tensordict left untouched" in message, message


def test_a_layout_from_the_wire_is_checked_and_a_bad_one_ignored():
    """The sender's layout is untrusted: anything that is not one (not zlib, not JSON, another form, longer than
    allowed once unpacked) parses to None, and the mismatch is then said by fingerprint; a good one round-trips."""
    import json
    import zlib

    from cudarecv.plan import describe
    from cudarecv.plan.plan import plan_for
    from cudarecv.wire import fast

    td = make("nested", 1.0)
    plan = plan_for(td)
    ours = describe.parse(plan.bucket_header.describe())
    assert ours is not None and [leaf.path for leaf in ours.leaves] == [
        "a.x.q",
        "a.y",
        "b",
        "c",
        "flag",
    ]
    assert describe.difference(ours, ours) is None

    def packed(value) -> bytes:
        return zlib.compress(json.dumps(value).encode())

    bad = [
        b"",
        b"not zlib",
        zlib.compress(b"{not json"),
        packed([1, 2]),
        packed({"kind": 1, "leaves": [["a"]]}),
        packed({"kind": 7, "leaves": [], "storage": None}),
        packed({"kind": 1, "leaves": [["a", "float32", [-1], 4, None]], "storage": None}),
        packed({"kind": 1, "leaves": [["a", "float32", [1], True, None]], "storage": None}),
        zlib.compress(b" " * (describe.MAX_DESCRIPTION + 1)),
        zlib.compress(b"[]")[:-3],
    ]
    assert [describe.parse(raw) for raw in bad] == [None] * len(bad)

    other = _changed(td, "shape")
    got = dataclasses.replace(plan_for(other).bucket_header, bucket_bytes=16)
    for theirs in (
        None,
        bad[3],
    ):  # not told, or told something that is not a layout: said by fingerprint
        said = fast._mismatch(plan.bucket_header, got, theirs)
        assert (
            said.startswith("fast-wire mismatch (the sender sends buckets")
            and "not known here" in said
        ), said
    said = fast._mismatch(plan.bucket_header, got, plan_for(other).bucket_header.describe())
    assert said.startswith("fast-wire mismatch at key 'b' differs in shape"), said
