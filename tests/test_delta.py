"""Delta pushes (``WeightSender(delta=True)``): the codec (:mod:`cudarecv.weights.delta`) against random data and
corrupted patches, and real ranks over gloo: every version bit-exact on every receiver, a few percent of the bytes
on the wire, a corrupted or misapplied patch rejected and repaired by the next push, whole.

Rank 0 is the trainer; the others are actors. Versions are reproducible on both sides: :func:`version_td` makes
version ``k`` of a bf16 model whose steps each change ``FRACTION`` of its elements at random positions.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import cudarecv
from churn import fork_process, master_store, store_client
from cudarecv.weights import delta
from cudarecv.weights.delta import PatchError
from cudarecv.weights.wire import LANDED
from procs import stop_here

FRACTION = 0.01
MIB = 1 << 20


def base_td() -> TensorDict:
    """A model's weights: bf16 matrices (most bytes), an fp32 norm, an int64 step counter."""
    gen = torch.Generator().manual_seed(7)
    return TensorDict(
        {
            "embed": torch.randn(512, 1024, generator=gen).to(torch.bfloat16),
            "layer": {"w": torch.randn(1000, 500, generator=gen).to(torch.bfloat16)},
            "norm": torch.randn(300, generator=gen),
            "steps": torch.zeros(1, dtype=torch.int64),
        },
        batch_size=[],
    )


def step(td: TensorDict, version: int, fraction: float = FRACTION) -> None:
    """Version ``version`` from the one before it: ``fraction`` of each float leaf's elements move, the counter
    counts (the same on every rank: the positions and values come from ``version``)."""
    gen = torch.Generator().manual_seed(version)
    for key in ("embed", ("layer", "w"), "norm"):
        leaf = td.get(key).view(-1)
        count = max(1, int(leaf.numel() * fraction))
        where = torch.randperm(leaf.numel(), generator=gen)[
            :count
        ]  # (distinct: a repeat's add is racy)
        leaf[where] += torch.randn(count, generator=gen).to(leaf.dtype) * 0.01 + 0.001
    td.set_("steps", torch.full((1,), version, dtype=torch.int64))


def version_td(version: int, fractions: dict[int, float] | None = None) -> TensorDict:
    td = base_td()
    for v in range(1, version + 1):
        step(td, v, (fractions or {}).get(v, FRACTION))
    return td


# -- the codec ---------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    words=st.integers(1, 300_000),
    word=st.sampled_from([1, 2, 4, 8]),
    fraction=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_a_patch_turns_the_base_into_the_version_on_either_codec(words, word, fraction, seed):
    """Native (host) and torch (any device) codecs write the same patch bytes, and either applies either's."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (words * word,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    as_words = new.view(delta.WORD_DTYPES[word])
    changed = torch.randperm(words, generator=gen)[: int(words * fraction)]
    as_words[changed] += 1
    patches = [delta.encode(new, base, word, native=n) for n in (True, False)]
    if patches[0] is None:
        # (a patch is never larger than the version: all changed, or a storage too small for its fixed part)
        assert patches[1] is None and (fraction > 0.05 or words * word < 4096)
        return
    assert torch.equal(patches[0], patches[1])
    assert patches[0].numel() < new.numel()
    for native in (True, False):
        into = base.clone()
        delta.apply(patches[0], into, word, native=native)
        assert torch.equal(into, new)
    moved = base.clone()  # advance: the base becomes the version, writing the changed words only
    assert torch.equal(delta.encode(new, moved, word, advance=True), patches[0])
    assert torch.equal(moved, new)


def test_a_patch_is_a_few_percent_of_the_version_and_none_when_all_changed():
    base = torch.randint(0, 256, (8 * MIB,), dtype=torch.uint8)
    new = base.clone()
    words = new.view(torch.int16)
    words[torch.randperm(words.numel())[: words.numel() // 100]] += 1
    patch = delta.encode(new, base, 2)
    assert (
        patch is not None and 0.02 < patch.numel() / new.numel() < 0.035
    )  # 1% of words x (4 + 2) / 2 bytes
    words += 1
    assert delta.encode(new, base, 2) is None  # all changed: the version whole is smaller


def _patch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (3 * MIB + 48,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    words = new.view(torch.int16)
    words[:1000:7] += 1  # block 0: sparse
    words[MIB // 2 : MIB // 2 + 100_000 : 2] += 1  # block 1: a bitmask
    words[MIB:] += 1  # blocks 2 and the short last one: full
    patch = delta.encode(new, base, 2)
    assert patch is not None
    kinds = patch[delta.PREFIX.size : delta.PREFIX.size + 4].tolist()
    assert kinds == [delta.Block.SPARSE, delta.Block.BITMASK, delta.Block.FULL, delta.Block.FULL]
    return base, new, patch


CORRUPTIONS = {
    "truncated": lambda p: p[:-1],
    "a byte more": lambda p: torch.cat([p, p[:1]]),
    "the prefix": lambda p: _poke(p, 5, 0xFF),
    "a kind that does not exist": lambda p: _poke(p, delta.PREFIX.size, 9),
    "a kind changed": lambda p: _poke(p, delta.PREFIX.size, delta.Block.BITMASK),
    "a count": lambda p: _poke(p, delta.PREFIX.size + 8, 7),
    "an index out of its block": lambda p: _poke(p, delta.PREFIX.size + 8 + 32 + 3, 0x7F),
    "an index out of order": lambda p: _poke(p, delta.PREFIX.size + 8 + 32 + 4, 0),
}


def _poke(patch: torch.Tensor, at: int, value: int) -> torch.Tensor:
    patch = patch.clone()
    patch[at] = value
    return patch


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_patch_is_refused_before_anything_is_written(corruption, native):
    base, new, patch = _patch()
    into = base.clone()
    delta.apply(patch, into, 2, native=native)
    assert torch.equal(into, new)
    bad = CORRUPTIONS[corruption](patch)
    if corruption == "an index out of order" and not native:
        pytest.skip("torch's codec applies indices in any order (each lies in its block)")
    into = base.clone()
    with pytest.raises(PatchError, match="corrupted|cannot hold"):
        delta.apply(bad, into, 2, native=native)
    assert torch.equal(into, base)


def test_the_word_is_the_item_size_of_the_dtype_holding_most_bytes():
    schema = cudarecv.weights.schema.Schema.of(
        [("a",), ("b",), ("c",)],
        [
            torch.zeros(100, dtype=torch.float32),
            torch.zeros(1000, dtype=torch.bfloat16),
            torch.zeros(3, dtype=torch.bool),
        ],
    )
    assert delta.word_bytes(schema) == 2


# -- real ranks ----------------------------------------------------------------------------------------------------
def deltas(rank, world, group, steps, corrupt, fanout="star", lie=0):
    """Rank 0 pushes ``steps`` versions with ``delta=True`` (and verify) to every other rank on the wire; version
    ``corrupt`` (if any) has one byte of its patch flipped on the way. Each actor checks each version bit for bit."""
    td = version_td(0)
    if rank == 0:
        from cudarecv.weights import snapshots

        encode = snapshots.encode
        if corrupt:

            def corrupting(new, base, word, out=None, native=True, advance=False):
                patch = encode(new, base, word, out, native, advance)
                if patch is not None and int(td["steps"]) == corrupt:
                    patch[_first_value(patch, new.numel() // word)] ^= (
                        1  # (it applies; the digest disagrees)
                    )
                return patch

            snapshots.encode = corrupting
        sizes, errors = [], []
        with cudarecv.WeightSender(
            td,
            dst=list(range(1, world)),
            delta=True,
            verify=True,
            transport="wire",
            timeout=30,
            fanout=fanout,
        ) as sender:
            assert sender.fanout == fanout
            for version in range(1, steps + 1):
                step(td, version)
                if version == lie:  # (the sender wrongly believes rank 1 holds the version before)
                    member = next(m for m in sender._s.members if m.rank == 1)
                    member.got = dataclasses.replace(member.got, version=version - 1, status=LANDED)
                try:
                    assert sender.push() == version
                except cudarecv.ChecksumError as error:
                    errors.append((version, str(error)))
                sizes.append(sender.payload_bytes)
            total = sender.schema.total
            torch.distributed.barrier()  # (the receivers close after: each is served until then)
        snapshots.encode = encode
        assert sender._pool.base is None  # (closed: the base and its patch buffer let go of)
        return sizes, errors, total
    from cudarecv.weights import slots

    fills, fill = [], slots.Slot.fill  # (how often the published version is copied before a patch)
    slots.Slot.fill = lambda self, source: (fills.append(1), fill(self, source))[1]
    with cudarecv.WeightReceiver(src=0, expect=td, timeout=30) as receiver:
        seen = []
        expected = version_td(0)
        for version in range(1, steps + 1):
            step(expected, version)
            try:
                got = receiver.pull()
            except cudarecv.MismatchError as error:  # (a digest's, or a patch's base)
                seen.append((version, "rejected", receiver.version, type(error).__name__))
                continue
            exact = all(
                torch.equal(receiver.td.get(k).view(torch.uint8), expected.get(k).view(torch.uint8))
                for k in expected.keys(True, True)
            )
            seen.append((version, got, exact))
        torch.distributed.barrier()
    slots.Slot.fill = fill
    patches = receiver._puller.patches  # (closed: its patch buffers let go of)
    assert patches._buffers == [None, None] and patches._applied is None
    return seen, len(fills)


def _first_value(patch: torch.Tensor, words: int) -> int:
    """Where the first changed word's value lies in a patch (of a SPARSE block: these tests change 1%)."""
    _, word, block_words, blocks = delta.PREFIX.unpack(bytes(patch[: delta.PREFIX.size].numpy()))
    at = delta.PREFIX.size
    kinds = patch[at : at + blocks]
    counts = patch[at + -(-blocks // 8) * 8 :][: 8 * blocks].view(torch.int64)
    return delta.Layout.of(words, block_words, kinds, counts).offsets(word)[4]


@pytest.mark.parametrize("fanout", ["star", "relay"])
def test_every_version_arrives_bit_exact_as_a_few_percent_of_its_bytes(four, fanout):
    """Star: each receiver gets its patch from the sender; relay: the head of the chain gets it, and each hop
    forwards it as it is (the chain holds one base)."""
    results = four().run(deltas, args=(6, 0, fanout), timeout=120)
    sizes, errors, total = results[0]
    assert errors == []
    for rank in (1, 2, 3):
        seen, fills = results[rank]
        assert seen == [(v, v, True) for v in range(1, 7)]
        # version 2's patch: onto a copy of version 1; each later one onto the spare buffer's version, after
        # the patch before it (the spare holds the version before the published one): no copy of the version
        assert fills == 1
        sent = [s.get(rank) for s in sizes]
        if fanout == "relay" and rank != 1:  # (it got them from the hop before)
            assert sent == [0] * 6, sizes
            continue
        assert sent[0] == total, sizes  # the first version goes whole: nobody holds a base
        assert all(0 < s < 0.06 * total for s in sent[1:]), sizes


@pytest.mark.parametrize("fanout", ["star", "relay"])
def test_a_corrupted_patch_is_rejected_and_the_next_push_repairs_it_whole(four, fanout):
    """Version 3's patch is corrupted on the way: every receiver's digest check rejects it (its pull raises, it keeps
    version 2, and the sender's push names them); version 4 goes whole, 5 and 6 as patches again."""
    results = four().run(deltas, args=(6, 3, fanout), timeout=120)
    sizes, errors, total = results[0]
    assert [v for v, _ in errors] == [3]
    assert "rejected" in errors[0][1]
    for rank in (1, 2, 3):
        seen, _ = results[rank]
        assert seen[:2] == [(1, 1, True), (2, 2, True)]
        assert seen[2] == (3, "rejected", 2, "ChecksumError")
        assert seen[3:] == [(4, 4, True), (5, 5, True), (6, 6, True)]
        if fanout == "star" or rank == 1:
            assert sizes[3][rank] == total
            assert all(0 < sizes[v][rank] < 0.06 * total for v in (1, 2, 4, 5))


def test_threads_diff_ranges_of_blocks_into_the_same_patch(monkeypatch):
    """A large host storage is diffed by several threads, each a range of blocks writing its part of every
    section: the patch is byte for byte the single-threaded one (and torch's)."""
    monkeypatch.setattr(delta, "THREADS", 3)
    monkeypatch.setattr(delta.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert delta._parts(40, delta.PARALLEL_BYTES) == [(0, 13), (13, 26), (26, 40)]
    assert delta._parts(40, delta.PARALLEL_BYTES - 1) == [(0, 40)]
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (40 * MIB + 96,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    words = new.view(torch.int16)
    for block, step_ in (
        (0, 200),
        (7, 3),
        (13, 1),
        (25, 40),
        (39, 1),
    ):  # sparse, bitmask, full, sparse, full
        start = block * MIB // 2
        words[start : start + MIB // 2 : step_] += 1
    words[-5:] += 1  # (the short last block)
    patch = delta.encode(new, base, 2)
    assert patch is not None
    kinds = set(patch[delta.PREFIX.size : delta.PREFIX.size + 41].tolist())
    assert kinds == {delta.Block.SAME, delta.Block.SPARSE, delta.Block.BITMASK, delta.Block.FULL}
    assert torch.equal(patch, delta.encode(new, base, 2, native=False))
    moved = base.clone()
    assert torch.equal(delta.encode(new, moved, 2, advance=True), patch)
    assert torch.equal(moved, new)


def latest_deltas(rank, world, group, steps):
    """Latest mode: rank 0 pushes ``steps`` versions; after each, rank 1 pulls it, rank 2 every third, rank 3 the
    first and the last only. Each receiver gets a patch from the version it holds while a snapshot of the sender
    still holds that version (5 buffers: the last five versions), else the version whole; every version it
    publishes is bit-exact."""
    td = version_td(0)
    pulls = {1: set(range(1, steps + 1)), 2: set(range(1, steps + 1, 3)), 3: {1, steps}}
    if rank == 0:
        from cudarecv.weights.snapshots import SnapshotPool

        made: list[tuple[int, int, bool]] = []
        patch_from = SnapshotPool.patch_from

        def counting(pool, snapshot, held):
            patch = patch_from(pool, snapshot, held)
            made.append((snapshot.pushed.version, held, patch is not None))
            return patch

        SnapshotPool.patch_from = counting
        try:
            with cudarecv.WeightSender(
                td, dst=[1, 2, 3], mode="latest", delta=True, verify=True, transport="wire"
            ) as sender:
                for version in range(1, steps + 1):
                    step(td, version)
                    assert sender.push() == version
                    torch.distributed.barrier()  # the receivers pull it
                    torch.distributed.barrier()  # they have it
                torch.distributed.barrier()
        finally:
            SnapshotPool.patch_from = patch_from
        return made
    with cudarecv.WeightReceiver(src=0, expect=td, timeout=30) as receiver:
        expected, at, seen = version_td(0), 0, []
        for version in range(1, steps + 1):
            torch.distributed.barrier()
            if version in pulls[rank]:
                got = receiver.pull()
                while at < got:
                    at += 1
                    step(expected, at)
                exact = all(
                    torch.equal(
                        receiver.td.get(k).view(torch.uint8), expected.get(k).view(torch.uint8)
                    )
                    for k in expected.keys(True, True)
                )
                seen.append((got, exact))
            torch.distributed.barrier()
        torch.distributed.barrier()
        return seen


def test_latest_mode_patches_each_receiver_from_the_version_it_holds(four):
    results = four().run(latest_deltas, args=(12,), timeout=120)
    made = results[0]
    assert results[1] == [(v, True) for v in range(1, 13)]
    assert results[2] == [(v, True) for v in (1, 4, 7, 10)]
    assert results[3] == [(1, True), (12, True)]
    patched = {(version, held) for version, held, ok in made if ok}
    # rank 1 from the version before, rank 2 from three before (both still in a snapshot)
    assert {(v, v - 1) for v in range(2, 13)} <= patched
    assert {(4, 1), (7, 4), (10, 7)} <= patched
    # rank 3 holds version 1, long overwritten by version 12: no patch, the version whole
    assert (12, 1) not in patched


def exact(got: TensorDict, want: TensorDict) -> bool:
    return all(
        torch.equal(got.get(k).view(torch.uint8), want.get(k).view(torch.uint8))
        for k in want.keys(True, True)
    )


def delta_actor(conn, port: int, name: str, index: int, die_at: int) -> None:
    """A receiver that joined through the store: it pulls until the version ``delta/final`` names, saying in the
    store each version it got and whether it was bit-exact; with ``die_at``, it dies (SIGKILL) once that version's
    patch has landed, before it applies it."""
    conn.close()
    store = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store, name=name, timeout=8.0)
    store.set(f"delta/{index}/id", str(receiver.id))
    if die_at:
        apply = delta.Patches.apply

        def apply_or_die(self, nbytes, slot, published, stream):
            if receiver.version + 1 >= die_at:
                stop_here(signal.SIGKILL)
            apply(self, nbytes, slot, published, stream)

        delta.Patches.apply = apply_or_die
    expected, at, seen = version_td(0), 0, []
    while not (
        store.check(["delta/final"]) and seen and seen[-1][0] >= int(store.get("delta/final"))
    ):
        version = receiver.pull(timeout=120)
        while at < version:
            at += 1
            step(expected, at)
        with receiver.reading() as td:
            seen.append([version, exact(td, expected)])
        store.set(f"delta/{index}/seen", json.dumps(seen))
    store.wait(
        ["delta/done"], datetime.timedelta(seconds=120)
    )  # (served until the sender read its sizes)
    receiver.close()


@pytest.mark.timeout(300)
def test_a_receiver_killed_mid_delta_is_dropped_and_its_restart_gets_the_version_whole_then_patches():
    """Receivers that join through a store: receiver B dies once version 3's patch has landed in it (before it
    applies it); no push raises, A gets every version as patches; B restarted joins, gets its first version whole
    and the next ones as patches, every one bit-exact."""
    name, wait = "delta", datetime.timedelta(seconds=120)
    with master_store() as store:
        td = version_td(0)
        sender = cudarecv.ElasticSender(
            td, store=store, name=name, delta=True, verify=True, transport="wire", timeout=8.0
        )
        actors, sizes = [], {}

        def joined(count: int) -> None:
            deadline = time.monotonic() + 120
            while len(sender.ranks) < count:
                assert time.monotonic() < deadline, sender.receivers
                time.sleep(0.01)

        def push(version: int) -> None:
            step(td, version)
            assert sender.push() == version
            sizes[version] = dict(sender.payload_bytes)

        try:
            actors.append(fork_process(delta_actor, (store.port, name, 1, 0)))
            actors.append(fork_process(delta_actor, (store.port, name, 2, 3)))
            store.wait(["delta/1/id", "delta/2/id"], wait)
            joined(2)
            for version in range(1, 5):
                push(version)  # (B dies during version 3's: dropped, logged; the push returns)
            actors[1].join(120)
            assert actors[1].exitcode == -9
            actors.append(fork_process(delta_actor, (store.port, name, 3, 0)))
            store.wait(["delta/3/id"], wait)
            joined(2)
            store.set("delta/final", "8")
            for version in range(5, 9):
                push(version)
            store.set("delta/done", "1")
            for actor in (actors[0], actors[2]):
                actor.join(120)
                assert actor.exitcode == 0
            ids = {i: int(store.get(f"delta/{i}/id")) for i in (1, 2, 3)}
            seen = {i: json.loads(store.get(f"delta/{i}/seen")) for i in (1, 2, 3)}
            total = sender.schema.total
        finally:
            sender.close()
            for actor in actors:
                actor.kill()
    assert seen[1] == [[v, True] for v in range(1, 9)]
    assert seen[2] == [[1, True], [2, True]]  # (it died with version 3's patch landed, unapplied)
    assert ids[2] not in sizes[4] and ids[2] in sender.dropped
    assert seen[3] == [[v, True] for v in range(5, 9)]
    assert sizes[1][ids[1]] == total and all(
        0 < sizes[v][ids[1]] < 0.06 * total for v in range(2, 9)
    )
    assert sizes[5][ids[3]] == total  # the restarted receiver holds nothing: the version whole
    assert all(0 < sizes[v][ids[3]] < 0.06 * total for v in (6, 7, 8))


def test_a_patch_against_a_version_the_receiver_does_not_hold_is_rejected_and_repaired(four):
    """Version 3's patch is corrupted (every receiver rejects it and keeps version 2); the sender then wrongly
    believes rank 1 holds version 3 (a lost word, a bug) and sends it version 4's patch against 3: rank 1 rejects
    it (its base is 2), drained, in step; the others get version 4 whole. Version 5 repairs rank 1, whole."""
    results = four().run(deltas, args=(6, 3, "star", 4), timeout=120)
    sizes, errors, total = results[0]
    assert [v for v, _ in errors] == [3, 4]
    assert "rank 1" in errors[1][1] and "rank 2" not in errors[1][1]
    assert results[1][0][3] == (4, "rejected", 2, "PushHeaderError")
    assert results[1][0][4:] == [(5, 5, True), (6, 6, True)]
    assert sizes[3][1] < 0.06 * total and sizes[4][1] == total and sizes[5][1] < 0.06 * total
    for rank in (2, 3):
        assert results[rank][0][3:] == [(4, 4, True), (5, 5, True), (6, 6, True)]
        assert sizes[3][rank] == total and sizes[4][rank] < 0.06 * total


@pytest.mark.timeout(300)
def test_a_restarted_sender_sends_its_first_version_whole_then_patches():
    """A trainer that restarts (a new ElasticSender of the same name) knows no receiver's version: its first push
    to each is whole, the next ones patches; the receivers follow it and every version is bit-exact."""
    name = "restart"
    with master_store() as store:
        td, sizes = version_td(0), {}
        actor = fork_process(delta_actor, (store.port, name, 1, 0))
        try:
            for first, last in ((1, 3), (4, 6)):
                with cudarecv.ElasticSender(
                    td, store=store, name=name, delta=True, transport="wire", timeout=8.0
                ) as sender:
                    deadline = time.monotonic() + 120
                    while not sender.ranks:
                        assert time.monotonic() < deadline, sender.receivers
                        time.sleep(0.01)
                    if first == 4:
                        store.set("delta/final", "6")
                    for version in range(first, last + 1):
                        step(td, version)
                        assert sender.push() == version
                        sizes[version] = list(sender.payload_bytes.values())
                    total = sender.schema.total
                    if first == 4:
                        store.set("delta/done", "1")
            actor.join(120)
            assert actor.exitcode == 0
            seen = json.loads(store.get("delta/1/seen"))
        finally:
            actor.kill()
    assert seen == [[v, True] for v in range(1, 7)]
    assert sizes[1] == [total] and sizes[4] == [total]  # (each sender's first)
    assert all(0 < sizes[v][0] < 0.06 * total for v in (2, 3, 5, 6))


def fp32_td() -> TensorDict:
    """An fp32 trainer's weights (the int64 counter stays an integer on the wire)."""
    td = base_td()
    for key in ("embed", ("layer", "w")):
        td.set(key, td.get(key).float())
    return td


def to_wire(td: TensorDict) -> TensorDict:
    """What a receiver of ``wire_dtype=torch.bfloat16`` holds of ``td``."""
    return td.apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t.clone())


def wire_dtype_deltas(rank, world, group, steps):
    """An fp32 trainer sends bf16 (``wire_dtype``) with delta: rank 1 over the wire (patches computed in bf16),
    rank 2 through shared memory; rank 3 expects fp32 and is refused at the handshake."""
    td = fp32_td()
    if rank == 0:
        with pytest.raises(cudarecv.ArgumentError, match="wire_dtype"):
            cudarecv.WeightSender(td, dst=[1], wire_dtype=torch.int8)
        with pytest.raises(cudarecv.SchemaError, match="wire_dtype"):
            cudarecv.WeightSender(td, dst=[3], wire_dtype=torch.bfloat16, timeout=30)
        with cudarecv.WeightSender(
            td, dst=[1, 2], delta=True, verify=True, wire_dtype=torch.bfloat16, timeout=30
        ) as sender:
            dtypes = [leaf.dtype for leaf in sender.schema.leaves]
            assert dtypes == [torch.bfloat16] * 3 + [torch.int64]  # (the counter stays an integer)
            sizes = []
            for version in range(1, steps + 1):
                step(td, version)
                assert sender.push() == version
                sizes.append(sender.payload_bytes)
            transports, total = sender.transports, sender.schema.total
            torch.distributed.barrier()
        return sizes, transports, total
    if rank == 3:
        with pytest.raises(cudarecv.SchemaError):
            cudarecv.WeightReceiver(src=0, expect=td, timeout=30)
        torch.distributed.barrier()
        return None
    transport = "wire" if rank == 1 else "auto"
    with cudarecv.WeightReceiver(
        src=0, expect=to_wire(td), timeout=30, transport=transport
    ) as receiver:
        expected, seen = fp32_td(), []
        for version in range(1, steps + 1):
            step(expected, version)
            seen.append((receiver.pull(), exact(receiver.td, to_wire(expected))))
        torch.distributed.barrier()
        return seen


def test_an_fp32_trainer_sends_bf16_on_the_wire_and_diffs_in_bf16(four):
    results = four().run(wire_dtype_deltas, args=(5,), timeout=120)
    sizes, transports, total = results[0]
    assert transports == {1: "wire", 2: "shared memory"}
    for rank in (1, 2):
        assert results[rank] == [(v, True) for v in range(1, 6)]
    assert sizes[0][1] == total and all(0 < s[1] < 0.06 * total for s in sizes[1:])
    assert all(s[2] == 0 for s in sizes)  # (shared memory: the header alone)


def sliced_td(version: int) -> TensorDict:
    """A plain trainer's weights at ``version``: 1% of the elements move per version (as :func:`step`)."""
    td = TensorDict(
        {
            "w": torch.randn(400, 300, generator=torch.Generator().manual_seed(1)),
            "b": torch.randn(300, generator=torch.Generator().manual_seed(2)),
        },
        [],
    )
    for v in range(1, version + 1):
        gen = torch.Generator().manual_seed(v)
        for leaf in td.values():
            flat = leaf.view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
            flat[where] += 0.25
    return td


SLICES = {1: {"w": (slice(0, 100),)}, 2: {"w": (slice(None), slice(50, 250))}, 3: None}


def sharded_deltas(rank, world, group, steps, wire_dtype):
    """A ``ShardedSender`` of plain fp32 tensors with ``delta=True`` (and ``wire_dtype``): each receiver wants
    other slices (rows, columns, all), lands them where its leaves lie, and gets each version after the first as
    patches of its pieces."""
    cast = (lambda t: t) if wire_dtype is None else (lambda t: t.to(wire_dtype))
    if rank == 0:
        td = sliced_td(1)
        sizes = []
        with cudarecv.ShardedSender(
            td,
            dst=[1, 2, 3],
            delta=True,
            verify=True,
            transport="wire",
            timeout=30,
            wire_dtype=wire_dtype,
        ) as sender:
            for version in range(1, steps + 1):
                td.update_(sliced_td(version))
                sender.push()
                sizes.append(sender.payload_bytes)
            torch.distributed.barrier()
        return sizes
    want = SLICES[rank]
    with cudarecv.ShardedReceiver(src=[0], want=want, timeout=30, transport="wire") as receiver:
        seen = []
        for version in range(1, steps + 1):
            got = receiver.pull()
            full = sliced_td(version)
            seen.append(
                (
                    got,
                    all(
                        torch.equal(
                            receiver.td[k], cast(full[k][(want or {}).get(k, (slice(None),))])
                        )
                        for k in ("w", "b")
                    ),
                )
            )
        torch.distributed.barrier()
        return seen


@pytest.mark.parametrize("wire_dtype", [None, torch.bfloat16], ids=["fp32", "bf16_on_the_wire"])
def test_a_sharded_sender_sends_each_receivers_pieces_as_patches(four, wire_dtype):
    results = four().run(sharded_deltas, args=(5, wire_dtype), timeout=120)
    sizes = results[0]
    for rank in (1, 2, 3):
        assert results[rank] == [(v, True) for v in range(1, 6)]
        first = sizes[0][rank]
        assert all(0 < s[rank] < 0.1 * first for s in sizes[1:]), (rank, sizes)


def relay_head_dies(rank, world, group, steps, key):
    """Delta through the chain 1 -> 2 -> 3 (16 KiB messages: a patch is several); the head dies once a message of
    version 3's patch has landed in it: ranks 2 and 3 lose that patch (``RelayLost``) and keep version 2; the next
    version goes whole through the chain 2 -> 3 (their word on version 3 said they hold none of the sender's base),
    and the ones after as patches again."""
    from cudarecv.weights import relay
    from rawwire import store

    signals, td = store(), version_td(0)
    if rank == 0:
        sizes, failures = [], []
        with cudarecv.WeightSender(
            td,
            dst=[1, 2, 3],
            fanout="relay",
            delta=True,
            verify=True,
            bucket_bytes=16 << 10,
            timeout=30,
        ) as sender:
            for version in range(1, steps + 1):
                step(td, version)
                try:
                    sender.push()
                except cudarecv.Error as error:
                    failures.append((version, type(error).__name__))
                sizes.append(sender.payload_bytes)
            total = sender.schema.total
            signals.set(f"{key}_read", "1")  # ranks 2 and 3 may close now
            signals.wait([f"{key}_done_2", f"{key}_done_3"])
        return sizes, failures, total
    with cudarecv.WeightReceiver(src=0, expect=td, timeout=30) as receiver:
        if rank == 1:
            landed = relay.Relay.landed

            def landed_then_die(self, i: int) -> None:
                landed(self, i)
                if self.version == 3 and i == 1:  # (mid-patch: message 0 is on its way down)
                    stop_here(signal.SIGKILL)

            relay.Relay.landed = landed_then_die
            while receiver.pull() < 3:
                pass
            raise AssertionError("rank 1 pulled version 3 whole")
        expected, at, seen = version_td(0), 0, []
        while receiver.version < steps:
            try:
                got = receiver.pull()
            except cudarecv.RelayLost:
                seen.append(("lost", receiver.version))
                continue
            while at < got:
                at += 1
                step(expected, at)
            seen.append((got, exact(receiver.td, expected)))
        signals.wait([f"{key}_read"])  # (served until the sender has looked)
        signals.set(f"{key}_done_{rank}", "1")
        return seen


def test_a_patch_lost_in_a_relay_chain_is_repaired_whole_through_the_healed_chain(four):
    from cudarecv.testing.launch import RankExit
    from rawwire import unique_key

    try:
        (sizes, failures, total), head, seen2, seen3 = four().run(
            relay_head_dies, args=(6, unique_key("delta_relay")), may_die={1}, timeout=120
        )
    finally:
        four().close()  # rank 1 is dead: the next test needs new groups
    assert isinstance(head, RankExit) and head == -signal.SIGKILL, head
    assert failures == [(3, "PeerError")], failures
    for seen in (seen2, seen3):
        assert seen == [(1, True), (2, True), ("lost", 2), (4, True), (5, True), (6, True)], seen
    # the head of the chain: rank 1, then rank 2 once 1 is gone; version 4 whole, 5 and 6 patches
    assert sizes[0] == {1: total, 2: 0, 3: 0} and 0 < sizes[1][1] < 0.06 * total, sizes
    assert sizes[3] == {2: total, 3: 0}, sizes
    assert all(0 < s[2] < 0.06 * total and s[3] == 0 for s in sizes[4:]), sizes
