"""Same-host transports: the fast wire and weight sync through shared memory between two real processes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.core import host_copy, tags
from cudarecv.plan.header import STORAGE_SLOTS, Header
from cudarecv.samehost import policy, records, recv_side, sides
from cudarecv.samehost import shared_memory as _shared_memory
from cudarecv.samehost.shared_memory import Mapping, Segment, map_offer, offer
from cudarecv.testing.launch import Cluster, RankExit
from cudarecv.wire import fast as _fast_wire
from rawwire import raw_send, set_flag, store, unique_key, wait_flag
from tdfactory import STRUCTURES, leaves, make, same


def _memfds() -> int:
    """How many memfd segments this process still holds a descriptor of."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += "memfd:cudarecv" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def transfers(rank, world, group, consolidated, transports):
    """Every structure, several steps each: values exact, and which transport carried each."""
    sending = rank == 0
    peer = (
        {"group": group, ("group_dst" if sending else "group_src"): 1 - rank}
        if group is not None
        else {}
    )
    args = () if group is not None else (1 - rank,)
    seen, ok = [], {}
    for structure in STRUCTURES:
        for step in range(3):
            td = make(structure, 5.0 + step if sending else 0.0)
            if consolidated:
                td = td.consolidate(metadata=True)
            kw = dict(peer, bucket_bytes=64, consolidated=consolidated, transport=transports[rank])
            if sending:
                [t] = cudarecv.isend(td, *args, **kw, return_early=True)
                assert t.wait(timeout=20) is None
            else:
                [t] = cudarecv.irecv(td, *args, **kw, return_premature=True)
                assert t.wait(timeout=20) is td
                ok[(structure, step)] = same(td, make(structure, 5.0 + step))
            seen.append(t.transport)
    return seen, ok, _memfds()


@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
def test_fast_wire_goes_through_shared_memory_after_one_offer(cluster, consolidated, standalone):
    (sent, _, held), (received, ok, _) = cluster().run(
        transfers, args=(consolidated, ("auto", "auto")), standalone=standalone
    )
    assert ok and all(ok.values()), [k for k, v in ok.items() if not v]
    assert sent == received, "both ends must agree on what carried each transfer"
    # the link was negotiated by an earlier test or by this one's first transfer (whose payload is on the wire);
    # a larger tensordict than the segments hold goes once on the wire with a new offer
    assert sent.count("shared memory") >= len(sent) - len(STRUCTURES), sent
    assert held == 0, "the sender still holds descriptors of segments the receiver has mapped"


def direct_transfers(rank, world, group, consolidated):
    """:func:`transfers`, and what the sending side was told it may send by the direct route."""
    seen, ok, held = transfers(rank, world, group, consolidated, ("auto", "auto"))
    senders = [
        side
        for (_, role), side in sides.sides_of(
            group if group is not None else dist.group.WORLD
        ).items()
        if role == "send"
    ]
    return seen, ok, held, [(side.direct, side.direct_storages) for side in senders]


@pytest.mark.parametrize("consolidated", [False, True], ids=["leaves", "storages"])
@pytest.mark.parametrize("told", ["on", "off"])
def test_the_direct_route_carries_leaves_and_private_storages_exactly(consolidated, told):
    """Whatever this machine's probe would choose: the direct route (the receiver reads the sender's
    leaves, or its private consolidated storage, straight out of it) and the segments, every structure."""
    with Cluster(2, pg_timeout=20.0, env={host_copy.DIRECT_ENV: told}) as ranks:
        (sent, _, _, agreed), (received, ok, _, _) = ranks.run(
            direct_transfers, args=(consolidated,)
        )
    assert ok and all(ok.values()), [k for k, v in ok.items() if not v]
    assert sent == received and sent.count("shared memory") >= len(sent) - len(STRUCTURES), sent
    assert agreed == [(told == "on", told == "on")], agreed


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_transport_wire_keeps_the_payload_on_the_wire(cluster, who):
    transports = ("wire", "auto") if who == "sender" else ("auto", "wire")
    # a new group per run: a link that agreed on shared memory before stays so (the sender's "wire" would
    # still force the wire; a receiver's "wire" only declines offers)
    (sent, _, _), (received, ok, _) = cluster().run(
        fresh_link, args=(transports, unique_key("fresh"))
    )
    assert all(ok.values())
    assert set(sent) == set(received) == {"wire"}, (sent, received)


def _group(rank, world, key):
    """A new gloo group of the ranks (on a prefix of the default store that both ranks are given)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(key, store()), rank, world, timedelta(seconds=20))


def fresh_link(rank, world, group, transports, key):
    pg = _group(rank, world, key)
    return transfers(rank, world, pg, False, transports)


def test_environment_variable_turns_it_off():
    with Cluster(2, pg_timeout=20.0, env={policy.ENV: "wire"}) as ranks:
        (sent, _, _), (received, ok, _) = ranks.run(transfers, args=(False, ("auto", "auto")))
    assert all(ok.values()) and set(sent) == set(received) == {"wire"}


def mismatch_on_shared_route(rank, world, group):
    """Once shared: a mismatched header is rejected (its READYs taken), the tensordict untouched, the link in step."""
    good = make("nested", 3.0 if rank == 0 else 0.0)
    bad = good.clone()
    bad["b"] = good["b"].to(torch.int32)  # same bytes (fits the segments), another dtype
    if rank == 0:
        routes = []
        for td in (good, good, bad, good):
            [t] = cudarecv.isend(td, 1, bucket_bytes=32, return_early=True)
            t.wait(20)
            routes.append(t.transport)
        return routes
    cudarecv.recv(good, 0, bucket_bytes=32)
    cudarecv.recv(good, 0, bucket_bytes=32)
    before = good.clone()
    with pytest.raises(cudarecv.HeaderError, match="drained") as error:
        cudarecv.recv(good, 0, bucket_bytes=32)
    untouched = same(good, before)
    cudarecv.recv(good, 0, bucket_bytes=32)
    return str(error.value), untouched, same(good, make("nested", 3.0))


def test_mismatch_through_shared_memory_is_rejected_and_the_link_survives(cluster):
    routes, (message, untouched, next_ok) = cluster().run(mismatch_on_shared_route)
    assert routes[2:] == ["shared memory", "shared memory"], routes
    assert "fast-wire mismatch" in message and untouched and next_ok


def any_order(rank, world, group):
    """Two transfers with different init_tags in flight at once, waited in the other order."""
    a, b = (torch.full((5000,), float(rank + k)) for k in (10, 20))
    tds = [TensorDict(x=a), TensorDict(x=b)]
    if rank == 0:
        for _ in range(2):  # the first round may negotiate
            hs = [
                cudarecv.isend(td, 1, bucket_bytes=4096, init_tag=k, return_early=True)[0]
                for k, td in enumerate(tds)
            ]
            for h in reversed(hs):
                h.wait(20)
        return [h.transport for h in hs]
    out = []
    for _ in range(2):
        for td in tds:
            td["x"].zero_()
        hs = [
            cudarecv.irecv(td, 0, bucket_bytes=4096, init_tag=k, return_premature=True)[0]
            for k, td in enumerate(tds)
        ]
        for h in reversed(hs):
            h.wait(20)
        out.append((bool((tds[0]["x"] == 10).all()), bool((tds[1]["x"] == 20).all())))
    return out


def test_two_transfers_in_flight_are_waited_in_any_order(cluster):
    routes, got = cluster().run(any_order)
    assert routes == ["shared memory"] * 2 and got == [(True, True)] * 2


# -- safety ---------------------------------------------------------------------------------
def test_segments_are_anonymous_owner_only_and_mapped_read_only():
    before = set(os.listdir("/dev/shm"))
    segment = Segment(1 << 16)
    assert os.fstat(segment.fd).st_mode & 0o777 == 0o600
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith(
        "/memfd:cudarecv"
    )  # no name in any directory
    [mapping] = map_offer(offer([segment]), 1 << 20)
    segment.data[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert mapping.data[:3].tolist() == [1, 2, 3]
    start = mapping.data.data_ptr()
    with open("/proc/self/maps") as maps:
        perms = [
            line.split()[1]
            for line in maps
            if int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16)
        ]
    assert perms == ["r--s"], perms  # the reader can never write the writer's memory
    with pytest.raises(OSError, match="nonce"):
        Mapping(
            os.getpid(), segment.fd, segment.capacity, bytes(16)
        )  # not the segment it was offered
    segment.close_fd()
    assert set(os.listdir("/dev/shm")) == before


@pytest.mark.skipif(not host_copy.NATIVE, reason=host_copy.WHY_NOT_NATIVE or "")
def test_the_progress_word_names_its_transfer():
    segment = Segment(1 << 16)
    [mapping] = map_offer(offer([segment]), 1 << 20)
    segment.close_fd()
    assert mapping.progress(1) is None  # nothing published yet: the reader waits for READYs
    segment.start(7)
    assert (
        mapping.progress(7) == 0 and mapping.progress(6) is None
    )  # another transfer's word is not this one's
    segment.advance(4096)
    assert mapping.progress(7) == 4096
    segment.start(8)  # the next transfer on this segment starts from nothing
    assert mapping.progress(8) == 0 and mapping.progress(7) is None


@pytest.mark.skipif(not host_copy.NATIVE, reason=host_copy.WHY_NOT_NATIVE or "")
def test_a_reader_sleeps_on_the_progress_word_until_the_writer_advances():
    """No polling: a reader whose word stands still sleeps in the kernel (no CPU) until the time runs out,
    and one asleep is woken by the writer's next store."""
    import threading

    segment = Segment(1 << 16)
    [mapping] = map_offer(offer([segment]), 1 << 20)
    segment.close_fd()
    segment.start(3)
    cpu, wall = time.thread_time(), time.monotonic()
    assert not mapping.follow(0, 0.3)
    assert time.monotonic() - wall >= 0.3 and time.thread_time() - cpu < 0.05, (
        "it polled instead of sleeping"
    )
    woken = []
    reader = threading.Thread(target=lambda: woken.append(mapping.follow(0, 30)))
    reader.start()
    segment.advance(
        4096
    )  # (if the reader is not asleep yet, the word has moved already: it returns at once)
    reader.join(30)
    assert woken == [True] and mapping.progress(3) == 4096


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_cannot_open_a_segment():
    segment = Segment(4096)
    path = f"/proc/{os.getpid()}/fd/{segment.fd}"
    code = f"import os\ntry:\n    os.open({path!r}, os.O_RDONLY)\nexcept PermissionError:\n    print('denied')\n"
    out = subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            sys.executable,
            "-I",
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "denied", (out.stdout, out.stderr)


def forged_ready(rank, world, group, lie, key):
    """A sender whose READY names bytes outside the plan, or a segment that does not exist: refused
    before anything is read (on a group of its own: the link is out of step afterwards)."""
    pg = _group(rank, world, key)
    td = TensorDict(x=torch.full((1000,), 7.0 if rank == 0 else 0.0))
    if rank == 0:
        for _ in range(2):  # negotiate, then one through the segment
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1024)
        schema = cudarecv.plan.plan.plan_for(td).bucket_header.schema
        if lie == "segment":
            route = Header(1, 1, 4000, 1024, schema, transport=1, segment=1, seq=99).pack()
            raw = bytearray(route)
            raw[13] = 7  # segment 7 (the crc is recomputed below)
            import struct
            import zlib

            struct.pack_into("<I", raw, 60, zlib.crc32(bytes(raw[:60])))
            raw_send(pg, 1, bytes(raw), tags.header_tag(0))
            return None
        raw_send(
            pg,
            1,
            Header(1, 1, 4000, 1024, schema, transport=1, segment=0, seq=99).pack(),
            tags.header_tag(0),
        )
        offset, length = (1 << 40, 1024) if lie == "offset" else (0, 1 << 20)
        ready = records.READY.pack(0, 99, offset, length)
        raw_send(pg, 1, ready, tags.piece_tag(0))
        return None
    for _ in range(2):
        cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1024)
    td["x"].zero_()
    with pytest.raises(cudarecv.OutOfStepError) as error:
        cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1024, timeout=20)
    return str(error.value), bool((td["x"] == 0).all())


@pytest.mark.parametrize("lie", ["offset", "length", "segment"])
def test_a_lying_peer_cannot_make_the_receiver_read_outside_its_segment(cluster, lie):
    _, (message, untouched) = cluster().run(forged_ready, args=(lie, unique_key("forged")))
    assert untouched
    if lie == "segment":
        assert "unknown payload route" in message
    else:
        assert "READY message 0 names" in message and "not read" in message


def forged_progress(rank, world, group, lie, key):
    """A sender whose progress word lies (far past the transfer's end, or back to nothing): the receiver never
    reads outside its own plan and segment; it waits for the READY instead (a word past the end is no word),
    and the values are the sender's."""
    pg = _group(rank, world, key)
    td = TensorDict(x=torch.zeros(1 << 20)).consolidate(metadata=True)  # 4 MiB in 4 messages
    if rank == 0:
        for _ in range(2):  # negotiate, then one through the segments
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1 << 20, consolidated=True)
        advance = Segment.advance
        Segment.advance = lambda segment, nbytes: advance(
            segment, (1 << 62) if lie == "past_the_end" else 0
        )
        td["x"].fill_(3.0)
        try:
            cudarecv.send(
                td, group=pg, group_dst=1, bucket_bytes=1 << 20, consolidated=True, timeout=30
            )
        finally:
            Segment.advance = advance
        td["x"].fill_(4.0)
        cudarecv.send(
            td, group=pg, group_dst=1, bucket_bytes=1 << 20, consolidated=True, timeout=30
        )
        return None
    for _ in range(2):
        cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1 << 20, consolidated=True)
    cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1 << 20, consolidated=True, timeout=30)
    lied = set(td["x"].unique().tolist())
    cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1 << 20, consolidated=True, timeout=30)
    return lied, bool((td["x"] == 4.0).all())


@pytest.mark.parametrize("lie", ["past_the_end", "nothing"])
def test_a_lying_progress_word_never_makes_the_receiver_read_outside_its_plan(cluster, lie):
    _, (lied, after) = cluster().run(forged_progress, args=(lie, unique_key("progress")))
    assert lied == {3.0}, f"the receiver copied bytes the sender had not written yet: {lied}"
    assert after, "the transfer after the lying one did not deliver exact values"


def group_dropped_after_sending(rank, world, group, key):
    """The sender drops its group as soon as its third send returned (the bytes in its segment), before the
    receiver says DONE for it (held back here until then): what was sent is received, whole."""
    pg = _group(rank, world, key)
    td = TensorDict(x=torch.zeros(1 << 16))
    signals = store()
    if rank == 0:
        for k in range(3):
            td["x"].fill_(k + 1)
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1 << 16, timeout=30)
        del pg
        gc.collect()
        signals.set(f"{key}_dropped", "1")
        return None
    done = recv_side.RecvSide.done

    def after_the_drop(side, lane, seq, k):
        signals.wait([f"{key}_dropped"])
        done(side, lane, seq, k)

    got = []
    for k in range(3):
        if k == 2:
            recv_side.RecvSide.done = after_the_drop
        try:
            [transfer] = cudarecv.irecv(
                td, group=pg, group_src=0, bucket_bytes=1 << 16, timeout=30, return_premature=True
            )
            transfer.wait()
        finally:
            recv_side.RecvSide.done = done
        got.append((transfer.transport, bool((td["x"] == k + 1).all())))
    return got


def test_a_send_completed_before_its_sender_dropped_the_group_is_received(cluster):
    """(Failed before: the receiver's DONE to the gone sender failed the transfer whose bytes were all in.)"""
    _, got = cluster().run(group_dropped_after_sending, args=(unique_key("dropped"),))
    assert got[2] == ("shared memory", True), got


def _causes(error: BaseException) -> list[str]:
    """The texts of ``error``'s chain of causes."""
    out = []
    while (error := error.__cause__) is not None:
        out.append(str(error))
    return out


def _in_our_words(kind: str, message: str, causes: list[str]) -> None:
    """A dead peer's error says so in cudarecv's words; gloo's own text is only its cause."""
    assert not any(raw in message for raw in ("gloo", "pair.cc", "GLHF", "Connection closed")), (
        message
    )
    if kind == "PeerError":
        assert any("gloo" in cause for cause in causes), causes


def killed_mid_stream(rank, world, group, victim, key, storage):
    """The victim SIGKILLs itself after three transfers; the survivor's next ones fail, bounded. With
    ``storage`` the sender's tensordict is consolidated into shared memory (the storage route)."""
    td = TensorDict(x=torch.zeros(1 << 18))
    if storage:
        td = td.consolidate(metadata=True, share_memory=rank == 0)
    op = functools.partial(cudarecv.send if rank == 0 else cudarecv.recv, consolidated=storage)
    peer = 1 - rank
    for _ in range(3):
        op(td, peer, bucket_bytes=1 << 16)
    # each waits until the other is done with its three: a send may end before its receiver has the bytes,
    # and a receive before its DONE has left (the sender's third send would fail, not a later one)
    store().set(f"{key}_{rank}", "1")
    if rank == victim:
        store().wait([f"{key}_{peer}"])
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(cudarecv.LinkError) as error:
        for _ in range(10):  # a sender learns it at its next wait for the receiver's DONE
            op(td, peer, bucket_bytes=1 << 16, timeout=15)
    return (
        type(error.value).__name__,
        str(error.value),
        time.monotonic() - started,
        _causes(error.value),
    )


@pytest.mark.parametrize("storage", [False, True], ids=["segments", "storage"])
@pytest.mark.parametrize("victim", [0, 1], ids=["sender_killed", "receiver_killed"])
def test_a_peer_killed_with_sigkill_leaves_nothing_and_fails_bounded(victim, storage):
    before = set(os.listdir("/dev/shm"))
    with Cluster(2, pg_timeout=20.0) as ranks:
        results = ranks.run(
            killed_mid_stream,
            args=(victim, unique_key("killed"), storage),
            may_die={victim},
            timeout=90,
        )
    assert isinstance(results[victim], RankExit)
    kind, message, took, causes = results[1 - victim]
    assert kind in ("PeerError", "TransferTimeout") and f"rank {victim}" in message and took < 40, (
        results
    )
    _in_our_words(kind, message, causes)
    left = {name for name in set(os.listdir("/dev/shm")) - before if not name.startswith("sem.mp-")}
    assert not left, (
        f"left in /dev/shm: {left}"
    )  # (sem.mp-*: multiprocessing's own, of the killed rank)


def killed_mid_transfer(rank, world, group, key):
    """The sender SIGKILLs itself halfway through its third transfer, once the receiver has its header and may
    have copied half of it (its progress word said so): the receiver's transfer fails, bounded, naming it.

    The sender dies only once the receiver reads the progress word (a store key): the header is a gloo send,
    which may still wait for the receiver's recv when the sender's copies are halfway, and a sender killed
    then fails the receiver at the header, not the payload this test is about."""
    td = TensorDict(x=torch.zeros(1 << 22)).consolidate(metadata=True)  # 16 MiB in 16 messages
    if rank == 0:
        for _ in range(2):  # the offer, then one through the segments
            cudarecv.send(td, 1, bucket_bytes=1 << 20, consolidated=True)
        advance = Segment.advance

        def dies_halfway(segment, nbytes):
            advance(segment, nbytes)
            if nbytes >= 8 << 20:
                wait_flag(f"{key}_header_in", 60)
                os.kill(os.getpid(), signal.SIGKILL)

        Segment.advance = dies_halfway
        cudarecv.send(td, 1, bucket_bytes=1 << 20, consolidated=True)
        return None
    for _ in range(2):
        cudarecv.recv(td, 0, bucket_bytes=1 << 20, consolidated=True)
    progress = Mapping.progress

    def reads_progress(mapping, seq):
        set_flag(f"{key}_header_in")  # (the receiver follows the payload once it has the header)
        return progress(mapping, seq)

    Mapping.progress = reads_progress
    started = time.monotonic()
    with pytest.raises(cudarecv.LinkError) as error:
        cudarecv.recv(td, 0, bucket_bytes=1 << 20, consolidated=True, timeout=15)
    return (
        type(error.value).__name__,
        str(error.value),
        time.monotonic() - started,
        _causes(error.value),
    )


def test_a_sender_killed_mid_transfer_fails_the_receiver_bounded():
    before = set(os.listdir("/dev/shm"))
    with Cluster(2, pg_timeout=20.0) as ranks:
        results = ranks.run(
            killed_mid_transfer, args=(unique_key("killed"),), may_die={0}, timeout=90
        )
    assert isinstance(results[0], RankExit)
    kind, message, took, causes = results[1]
    assert kind in ("PeerError", "TransferTimeout") and "rank 0" in message and took < 40, results
    # where it failed: the payload in the segment (before: "receive of the fast-wire header (tag 1073741824)")
    assert message.startswith("receive of the fast-wire payload through host segment "), message
    _in_our_words(kind, message, causes)
    left = {name for name in set(os.listdir("/dev/shm")) - before if not name.startswith("sem.mp-")}
    assert not left, f"left in /dev/shm: {left}"


def stopped_mid_transfer(rank, world, group, key):
    """The sender stops (SIGSTOP) halfway through its third transfer; the receiver's transfer times out,
    naming it, and lets it go on (SIGCONT); the sender's send then ends, bounded; another tensordict on
    another ``init_tag`` then goes through the link whole (the README's way on after a timeout)."""
    td = TensorDict(x=torch.zeros(1 << 22)).consolidate(metadata=True)  # 16 MiB in 16 messages
    signals = store()
    if rank == 0:
        signals.set(f"{key}_pid", str(os.getpid()))
        for _ in range(2):  # the offer, then one through the segments
            cudarecv.send(td, 1, bucket_bytes=1 << 20, consolidated=True)
        advance = Segment.advance

        def stops_halfway(segment, nbytes):
            advance(segment, nbytes)
            if nbytes >= 8 << 20 and Segment.advance is stops_halfway:
                Segment.advance = advance
                os.kill(os.getpid(), signal.SIGSTOP)

        Segment.advance = stops_halfway
        started = time.monotonic()
        try:
            cudarecv.send(td, 1, bucket_bytes=1 << 20, consolidated=True, timeout=10)
            outcome = "sent"
        except cudarecv.Error as error:
            outcome = type(error).__name__
        took = time.monotonic() - started
        other = TensorDict(x=torch.arange(1 << 22, dtype=torch.float32)).consolidate(metadata=True)
        cudarecv.send(other, 1, bucket_bytes=1 << 20, consolidated=True, init_tag=7, timeout=30)
        return outcome, took
    for _ in range(2):
        cudarecv.recv(td, 0, bucket_bytes=1 << 20, consolidated=True)
    started = time.monotonic()
    with pytest.raises(cudarecv.TransferTimeout) as error:
        cudarecv.recv(td, 0, bucket_bytes=1 << 20, consolidated=True, timeout=3)
    took = time.monotonic() - started
    os.kill(int(signals.get(f"{key}_pid")), signal.SIGCONT)
    other = TensorDict(x=torch.zeros(1 << 22)).consolidate(metadata=True)
    cudarecv.recv(other, 0, bucket_bytes=1 << 20, consolidated=True, init_tag=7, timeout=30)
    whole = bool(torch.equal(other["x"], torch.arange(1 << 22, dtype=torch.float32)))
    return str(error.value), took, whole


def test_a_sender_stopped_mid_transfer_times_out_the_receiver_and_the_link_goes_on():
    with Cluster(2, pg_timeout=30.0) as ranks:
        (outcome, sender_took), (message, took, whole) = ranks.run(
            stopped_mid_transfer, args=(unique_key("stopped"),), timeout=120
        )
    assert "rank 0" in message and took < 30, message
    assert outcome in ("sent", "TransferTimeout", "PeerError", "LinkError"), (
        outcome
    )  # bounded: it returned
    assert sender_took < 60, sender_took
    assert whole, "the transfer after the stopped one did not deliver exact values"


# -- weight sync -------------------------------------------------------------------------------
def _anonymous_memory() -> int:
    """This process's resident anonymous memory in bytes (mapped files and shared segments left out)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def shared_weights(rank, world, group, mode, transports, pulls, key, zero_copy=False):
    """Every version of ``pulls`` exact on every receiver; each rank's anonymous memory at a tenth of the
    pulls and at the end (the deadlines of its transfers, 300 s, all still to come)."""
    td = TensorDict(w=torch.zeros(100_000), b=TensorDict(c=torch.zeros(10, dtype=torch.int64)))
    memory = []
    if rank == 0:
        sender = cudarecv.WeightSender(
            td, dst=list(range(1, world)), mode=mode, timeout=300, transport=transports[0]
        )
        seen = sender.transports
        for version in range(1, pulls + 1):
            td["w"].fill_(version)
            td["b", "c"].fill_(version)
            sender.push()
            if (
                mode == "latest"
            ):  # every receiver pulls every version (else it would skip to the newest)
                store().wait([f"{key}_{r}_{version}" for r in range(1, world)])
            if version in (pulls // 10, pulls):
                memory.append(_anonymous_memory())
        store().wait([f"{key}_read"])
        sender.close()
        return seen, _memfds(), memory
    receiver = cudarecv.WeightReceiver(
        src=0, timeout=300, transport=transports[rank], zero_copy=zero_copy
    )
    ok = True
    for version in range(1, pulls + 1):
        got = receiver.pull()
        ok &= got == version and bool(
            (receiver.td["w"] == version).all() and (receiver.td["b", "c"] == version).all()
        )
        if mode == "latest":
            store().set(f"{key}_{rank}_{version}", "1")
        if version in (pulls // 10, pulls):
            memory.append(_anonymous_memory())
    if rank == 1:
        store().set(f"{key}_read", "1")
    transport = receiver.transport
    receiver.close()
    return transport, ok, memory


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_weight_sync_through_shared_memory(four, mode):
    (seen, held, _), *actors = four().run(
        shared_weights,
        args=(mode, ("auto", "auto", "wire", "auto"), 30, unique_key("w")),
        timeout=120,
    )
    assert seen == {1: "shared memory", 2: "wire", 3: "shared memory"}
    assert [a[0] for a in actors] == ["shared memory", "wire", "shared memory"]
    assert all(a[1] for a in actors), "a receiver got a wrong version"
    assert held == 0


@pytest.mark.parametrize(
    "mode, zero_copy",
    [("sync", False), ("sync", True), ("latest", True)],
    ids=["sync-copy", "sync-zero_copy", "latest-zero_copy"],
)
def test_steady_state_pulls_allocate_nothing(cluster, mode, zero_copy):
    """450 pulls leave both ends' anonymous memory flat (a receiver's words to the sender, two per pull of a
    zero-copy one, each about 2.5 KB, were kept until exit: 1.1 MB here; a deadline's entry lived its 300 s)."""
    (_, _, sent), (transport, ok, received) = cluster().run(
        shared_weights, args=(mode, ("auto", "auto"), 500, unique_key("w"), zero_copy), timeout=300
    )
    assert transport == "shared memory" and ok
    for end, (early, late) in (("sender", sent), ("receiver", received)):
        assert late - early < 512 << 10, (
            f"the {end}'s memory grew by {(late - early) / 1e6:.2f} MB over 450 pulls"
        )


def _in_mappings(receiver, tensor) -> bool:
    """Whether ``tensor`` lies in one of the sender's segments as ``receiver`` mapped them."""
    ptr = tensor.data_ptr()
    return any(
        m.data.data_ptr() <= ptr < m.data.data_ptr() + m.capacity for m in receiver._puller.mappings
    )


def zero_copy_weights(rank, world, group, mode, key):
    """Rank 1 publishes the sender's snapshots (zero-copy), rank 2 copies: every version exact on both; a
    version rank 1 holds with reading() stays whole while the sender pushes on (it writes other snapshots)."""
    td = TensorDict(w=torch.zeros(100_000), b=TensorDict(c=torch.zeros(10, dtype=torch.int64)))
    pulls = 30
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=[1, 2], mode=mode, timeout=20)
        aliases = [r.alias for r in sender._s.members]
        for version in range(1, pulls + 1):
            td["w"].fill_(version)
            td["b", "c"].fill_(version)
            sender.push()
            store().wait([f"{key}_{r}_{version}" for r in (1, 2)])  # each takes every version
        store().wait([f"{key}_closed"])
        retired = [s.retired for s in sender._pool.snapshots]
        sender.close()
        return aliases, retired
    receiver = cudarecv.WeightReceiver(src=0, timeout=20, zero_copy=rank == 1)
    ok, where, hold = True, True, None
    for version in range(1, pulls + 1):
        got = receiver.pull()
        ok &= got == version and bool(
            (receiver.td["w"] == version).all() and (receiver.td["b", "c"] == version).all()
        )
        where &= _in_mappings(receiver, receiver.td["w"]) == receiver.zero_copy
        if version == 5 and receiver.zero_copy:
            hold = receiver.reading()
            held = hold.__enter__()
        store().set(f"{key}_{rank}_{version}", "1")
    held_whole = None
    if hold is not None:
        held_whole = bool((held["w"] == 5).all() and (held["b", "c"] == 5).all())  # 25 pushes later
        hold.__exit__(None, None, None)
    zero_copy = receiver.zero_copy
    receiver.close()
    last = bool(
        (receiver.td["w"] == pulls).all()
    )  # readable after close (rank 1: in its own memory again)
    own = not _in_mappings(receiver, receiver.td["w"])
    if rank == 1:
        store().set(f"{key}_closed", "1")
    return zero_copy, ok, where, held_whole, last, own


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_zero_copy_receivers_publish_the_senders_snapshots(mode):
    with Cluster(3, pg_timeout=30.0) as ranks:
        (aliases, retired), zero, copy = ranks.run(
            zero_copy_weights, args=(mode, unique_key("zc")), timeout=120
        )
    assert aliases == [True, False]
    assert zero == (True, True, True, True, True, True), (
        zero
    )  # published where they lie, one held whole
    assert copy[:3] == (False, True, True) and copy[4:] == (True, True), copy
    assert not any(
        retired
    )  # rank 1 let go of every snapshot: it copied its last version out when it closed


def zero_copy_receiver_dropped(rank, world, group, key):
    """A zero-copy receiver that stops pulling is dropped; the snapshots it may still read are never written
    again (the sender goes on with the others, and with its own storage on the wire once too few are left)."""
    td = TensorDict(w=torch.zeros(50_000))
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=[1, 2], timeout=20)
        for version in (1, 2):
            td["w"].fill_(version)
            sender.push()
        td["w"].fill_(3)
        with pytest.raises(cudarecv.TransferTimeout, match="rank 1"):
            sender.push(timeout=2)  # rank 1 does not take it
        for version in range(4, 14):
            td["w"].fill_(version)
            sender.push()
        served, snapshots = sender.ranks, [(s.segment, s.retired) for s in sender._pool.snapshots]
        store().set(f"{key}_pushed", "1")
        return served, snapshots
    receiver = cudarecv.WeightReceiver(src=0, timeout=20, zero_copy=True)
    if rank == 1:
        for _ in (1, 2):
            receiver.pull()
        store().wait([f"{key}_pushed"])
        return (
            bool((receiver.td["w"] == 2).all()),
            receiver.version,
            _in_mappings(receiver, receiver.td["w"]),
        )
    versions = [receiver.pull() for _ in range(13)]
    ok = bool((receiver.td["w"] == 13).all())
    store().wait([f"{key}_pushed"])  # not closed before the sender looked at who it serves
    receiver.close()
    return versions, ok


def test_a_dropped_zero_copy_receiver_keeps_its_version_whole():
    with Cluster(3, pg_timeout=30.0) as ranks:
        (left, snapshots), dropped, other = ranks.run(
            zero_copy_receiver_dropped, args=(unique_key("zcd"),), timeout=120
        )
    assert left == [2]
    assert dropped == (True, 2, True), (
        dropped
    )  # its version 2, where it lies, untouched by 11 more pushes
    assert other == (list(range(1, 14)), True)
    assert [r for _, r in snapshots].count(True) == 2 and snapshots[-1][
        0
    ] is None  # version 2's and 3's; one added


def lying_sender_rewrites_a_held_snapshot(rank, world, group, key):
    """A sender that writes a snapshot the zero-copy receiver still publishes (its bookkeeping forged): the
    receiver refuses the push as out of step instead of publishing it."""
    pg = _group(rank, world, key)
    td = TensorDict(w=torch.zeros(1000))
    if rank == 0:
        sender = cudarecv.WeightSender(td, group=pg, group_dst=1, timeout=20)
        sender.push()
        with sender._s.cond:
            for snapshot in sender._pool.snapshots:
                snapshot.holders = 0  # as if the receiver had let go of version 1
            sender._s.members[0].holding.clear()
        assert (
            sender._pool._unheld() is sender._pool.snapshots[0]
        )  # the next push takes version 1's
        with pytest.raises(cudarecv.Error):
            sender.push(timeout=5)
        return None
    receiver = cudarecv.WeightReceiver(group=pg, group_src=0, timeout=20, zero_copy=True)
    receiver.pull()
    with pytest.raises(cudarecv.OutOfStepError, match="still holds") as error:
        receiver.pull()
    return str(error.value), receiver.version


def test_a_push_into_a_snapshot_the_receiver_holds_is_refused(cluster):
    _, (message, version) = cluster().run(
        lying_sender_rewrites_a_held_snapshot, args=(unique_key("zcl"),)
    )
    assert "zero-copy receiver still holds" in message and version == 1, message


def test_zero_copy_arguments_are_checked_before_anything_is_sent():
    with pytest.raises(cudarecv.ArgumentError, match="`zero_copy` must be True or False"):
        cudarecv.WeightReceiver(
            src=0, zero_copy="yes"
        )  # (no process group: the argument is checked first)
    with pytest.raises(cudarecv.ArgumentError, match="drop `pin_memory=True` or `zero_copy`"):
        cudarecv.WeightReceiver(src=0, zero_copy=True, pin_memory=True)


def test_bad_transport_is_refused_before_anything_is_sent(monkeypatch):
    td = TensorDict(x=torch.zeros(3))
    for call in (cudarecv.isend, cudarecv.send, cudarecv.irecv, cudarecv.recv):
        with pytest.raises(cudarecv.ArgumentError, match="`transport` must be one of"):
            call(
                td, 1, bucket_bytes=64, transport="shm"
            )  # (no process group: the argument is checked first)
    with pytest.raises(cudarecv.ArgumentError, match="`transport` must be one of"):
        cudarecv.WeightSender(td, dst=1, transport="ipc")
    with pytest.raises(cudarecv.ArgumentError, match="`transport` must be one of"):
        cudarecv.WeightReceiver(src=0, transport=None)
    monkeypatch.setenv(policy.ENV, "off")
    with pytest.raises(cudarecv.ArgumentError, match="CUDARECV_TRANSPORT='off' must be one of"):
        policy.allowed("auto")
    monkeypatch.setenv(policy.ENV, "wire")
    assert not policy.allowed("auto") and not policy.allowed("wire")
    monkeypatch.delenv(policy.ENV)
    assert policy.allowed("auto") and not policy.allowed("wire")


def third_send_times_out(rank, world, group, key):
    """Both segments in use and the receiver not receiving: the third send waits for the first's DONE and times
    out (bounded); once the receiver takes the first two, the link goes on."""
    pg = _group(rank, world, key)
    tds = [TensorDict(x=torch.full((4096,), float(k if rank == 0 else -1))) for k in range(6)]
    if rank == 0:
        for k in (0, 1):  # negotiate, then one through a segment
            cudarecv.send(tds[k], group=pg, group_dst=1, bucket_bytes=4096)
        a, b = (
            cudarecv.isend(tds[k], group=pg, group_dst=1, bucket_bytes=4096, return_early=True)[0]
            for k in (2, 3)
        )
        started = time.monotonic()
        with pytest.raises(cudarecv.TransferTimeout) as error:
            cudarecv.send(tds[4], group=pg, group_dst=1, bucket_bytes=4096, timeout=2)
        took = time.monotonic() - started
        store().set(key, "1")  # now the receiver takes the first two
        a.wait(20), b.wait(20)
        [last] = cudarecv.isend(tds[5], group=pg, group_dst=1, bucket_bytes=4096, return_early=True)
        last.wait(20)
        return str(error.value), took, [a.transport, b.transport, last.transport]
    for k in (0, 1):
        cudarecv.recv(tds[k], group=pg, group_src=0, bucket_bytes=4096)
    store().wait([key])
    for k in (2, 3, 5):
        cudarecv.recv(tds[k], group=pg, group_src=0, bucket_bytes=4096, timeout=20)
    return [bool((tds[k]["x"] == k).all()) for k in (2, 3, 5)]


def test_a_send_waiting_for_a_segment_times_out_bounded_and_the_link_goes_on(cluster):
    (message, took, routes), exact = cluster().run(
        third_send_times_out, args=(unique_key("third"),), timeout=90
    )
    assert "did not answer within 2 s" in message and took < 10, (message, took)
    assert exact == [True, True, True] and routes == ["shared memory"] * 3, (exact, routes)


# -- the storage route: a consolidated storage torch keeps in shared memory, read where it lies ----------------
def _maps_of(ptr: int) -> list[tuple[str, str]]:
    """(permissions, path) of this process's mappings holding address ``ptr``."""
    with open("/proc/self/maps") as maps:
        return [
            (line.split()[1], " ".join(line.split()[5:]))
            for line in maps
            if int(line.split("-")[0], 16) <= ptr < int(line.split()[0].split("-")[1], 16)
        ]


def storage_route(rank, world, group, rounds, key):
    """Every structure consolidated into shared memory on the sender, in turn for ``rounds`` rounds (more storages
    than a link keeps mapped: slots are taken over and offered again), its values changed in place each time."""
    pg, sending, seen, ok = _group(rank, world, key), rank == 0, [], {}
    kept = {s: make(s, 0.0).consolidate(metadata=True, share_memory=sending) for s in STRUCTURES}
    for step in range(rounds):
        for structure, td in kept.items():
            kw = dict(bucket_bytes=64, consolidated=True)
            if sending:
                for mine, value in zip(leaves(td), leaves(make(structure, 5.0 + step))):
                    mine.copy_(value)  # in place: the storage stays where it is
                [t] = cudarecv.isend(td, group=pg, group_dst=1, **kw, return_early=True)
                assert t.wait(timeout=20) is None
            else:
                for mine in leaves(td):
                    mine.zero_()
                [t] = cudarecv.irecv(td, group=pg, group_src=0, **kw, return_premature=True)
                assert t.wait(timeout=20) is td
                ok[(structure, step)] = same(td, make(structure, 5.0 + step))
            seen.append(t.transport)
    if sending:
        return seen, None
    side = sides.sides_of(pg)[(0, "recv")]
    mapped = [m for m in side.storages.values() if m is not None]
    return seen, (ok, [_maps_of(m.data.data_ptr()) for m in mapped])


def test_a_storage_in_shared_memory_is_read_where_it_lies(cluster):
    (sent, _), (received, (ok, maps)) = cluster().run(
        storage_route, args=(3, unique_key("storage"))
    )
    assert all(ok.values()) and len(ok) == 3 * len(STRUCTURES), ok
    assert sent == received and set(sent[1:]) == {"shared memory"}, (
        sent
    )  # after the first (the link's offer)
    assert len(maps) == STORAGE_SLOTS
    for found in maps:  # read-only views of torch's (unlinked) shared-memory files
        assert len(found) == 1 and found[0][0] == "r--s" and "/torch_" in found[0][1], found


def storage_unmappable(rank, world, group, key):
    """A receiver that cannot map the sender's storage: that transfer's payload comes on the wire, the later ones
    through the segments; every value exact."""
    td = TensorDict(x=torch.zeros(50_000), y=torch.zeros(3, dtype=torch.int64)).consolidate(
        metadata=True, share_memory=rank == 0
    )

    def refuse(raw, most_bytes):
        raise _shared_memory.MappingError("no mapping in this test")

    pg, seen, ok = _group(rank, world, key), [], []
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(
                recv_side, "StorageMapping", refuse
            )  # fault injection: this process alone
        for step in range(4):
            if rank == 0:
                td["x"].fill_(step + 1.5)
                td["y"].fill_(step)
                cudarecv.send(
                    td, group=pg, group_dst=1, bucket_bytes=1 << 14, consolidated=True, timeout=20
                )
            else:
                [t] = cudarecv.irecv(
                    td,
                    group=pg,
                    group_src=0,
                    bucket_bytes=1 << 14,
                    consolidated=True,
                    return_premature=True,
                )
                t.wait(timeout=20)
                seen.append(t.transport)
                ok.append(bool((td["x"] == step + 1.5).all() and (td["y"] == step).all()))
    return seen, ok


def test_a_storage_the_receiver_cannot_map_comes_on_the_wire_then_through_the_segments(cluster):
    _, (seen, ok) = cluster().run(storage_unmappable, args=(unique_key("unmappable"),))
    assert all(ok), ok
    assert seen == ["wire", "wire", "shared memory", "shared memory"], seen


def forged_storage(rank, world, group, lie, key):
    """A sender that names a storage slot it never offered, or offers a storage smaller than its header says:
    refused before a byte is read."""
    pg = _group(rank, world, key)
    td = TensorDict(x=torch.full((1000,), 7.0 if rank == 0 else 0.0)).consolidate(metadata=True)
    if rank == 0:
        for _ in range(2):  # negotiate, then one through a segment
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1024, consolidated=True)
        plan = cudarecv.plan.plan.plan_for(td)
        head = plan.chunk_header(td).for_transfer(1024, 0)
        if lie == "slot":
            raw_send(
                pg,
                1,
                dataclasses.replace(head, transport=2, segment=1, seq=99).pack(),
                tags.header_tag(0),
            )
            return None
        small = torch.zeros(100, dtype=torch.uint8).share_memory_()
        offered = _shared_memory.storage_offer(_shared_memory.shared_storage(small))
        raw_send(
            pg,
            1,
            dataclasses.replace(head, transport=2, segment=0, offer=True, seq=99).pack(),
            tags.header_tag(0),
        )
        raw_send(pg, 1, offered + bytes(_fast_wire.OFFER_SIZE - len(offered)), tags.header_tag(0))
        wait_flag(
            f"{key}_refused"
        )  # (the receiver maps it before this process, and its storage, go)
        return None
    for _ in range(2):
        cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1024, consolidated=True)
    td["x"].zero_()
    with pytest.raises(cudarecv.OutOfStepError) as error:
        cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1024, consolidated=True, timeout=20)
    set_flag(f"{key}_refused")
    return str(error.value), bool((td["x"] == 0).all())


@pytest.mark.parametrize("lie", ["slot", "size"])
def test_a_lying_peer_cannot_make_the_receiver_read_outside_a_storage(cluster, lie):
    _, (message, untouched) = cluster().run(
        forged_storage, args=(lie, unique_key("forged-storage"))
    )
    assert untouched
    assert ("never mapped" if lie == "slot" else "in a storage of 100") in message, message


def forged_table(rank, world, group, lie, consolidated, key):
    """A sender whose table of leaves, or of its private consolidated storage (the direct route), names other
    sizes, or memory it does not have, or that uses the direct route with a receiver that did not agree to it
    (``CUDARECV_DIRECT_READ=off``)."""
    pg = _group(rank, world, key)
    td = TensorDict(x=torch.full((1000,), 7.0 if rank == 0 else 0.0), y=torch.ones(10))
    if consolidated:
        td = td.consolidate(metadata=True)
    kw = dict(bucket_bytes=1024, consolidated=consolidated)
    if rank == 0:
        for _ in range(2):  # negotiate, then one transfer in shared memory
            cudarecv.send(td, group=pg, group_dst=1, **kw)
        plan = cudarecv.plan.plan.plan_for(td)
        if consolidated:
            table, head = sides.storage_table(plan.storage(td)), plan.chunk_header(td)
        else:
            table, head = plan.address_table.copy(), plan.bucket_header
        if lie == "sizes":
            table[0, 1] -= 8  # (with leaves: the same total, other leaves)
            if not consolidated:
                table[1, 1] += 8
        elif lie == "address":
            table[-1, 0] = 8  # an address this process has not mapped
        head = dataclasses.replace(head.for_transfer(1024, 0), transport=3, seq=99)
        raw_send(pg, 1, head.pack(), tags.header_tag(0))
        if lie != "not agreed":  # (refused at the header: the table is never taken)
            raw_send(pg, 1, table.tobytes(), tags.piece_tag(0))
        return None
    before = os.environ.get(host_copy.DIRECT_ENV)
    os.environ[host_copy.DIRECT_ENV] = (
        "off" if lie == "not agreed" else "on"
    )  # read when the offer is taken
    try:
        for _ in range(2):
            [t] = cudarecv.irecv(td, group=pg, group_src=0, **kw, return_premature=True)
            t.wait(timeout=20)
    finally:
        if before is None:
            del os.environ[host_copy.DIRECT_ENV]
        else:
            os.environ[host_copy.DIRECT_ENV] = before
    assert t.transport == "shared memory"
    td["x"].zero_()
    with pytest.raises(cudarecv.OutOfStepError) as error:
        cudarecv.recv(td, group=pg, group_src=0, **kw, timeout=20)
    return str(error.value), bool((td["x"] == 0).all())


@pytest.mark.parametrize("consolidated", [False, True], ids=["leaves", "storage"])
@pytest.mark.parametrize("lie", ["sizes", "address", "not agreed"])
def test_a_lying_peer_cannot_misplace_bytes_through_the_direct_route(cluster, lie, consolidated):
    _, (message, untouched) = cluster().run(
        forged_table, args=(lie, consolidated, unique_key("forged-table"))
    )
    what = "storage" if consolidated else "leaves"
    if lie == "sizes":
        assert (
            f"other sizes than this tensordict's {what}" in message
            and "not read" in message
            and untouched
        ), message
    elif lie == "not agreed":
        assert (
            f"names its {what} for a direct read this receiver never agreed to" in message
            and untouched
        ), message
    else:
        assert "partly written" in message, (
            message
        )  # (leaf x, read before the bad address, may be written)


def works_on_the_drivers_stack(rank, world, group, key):
    """Where each receive's result is set (its done callback runs there): which thread, and which of its frames
    still hold a gloo work at that moment."""
    import threading

    from torch._C._distributed_c10d import Work

    pg = _group(rank, world, key)
    td = make("nested", 2.0 if rank == 0 else 0.0)
    if rank == 0:
        for i in range(3):  # the first on the wire with the offer, then through the segments
            wait_flag(f"{key}_posted_{i}")  # (the receiver has posted and registered its callback)
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=64)
        return None
    seen = []

    def look(_: object) -> None:
        holding, frame = [], sys._getframe()
        while frame is not None:
            for value in list(frame.f_locals.values()):
                if any(
                    isinstance(v, Work)
                    for v in (value if isinstance(value, (list, tuple)) else (value,))
                ):
                    holding.append(frame.f_code.co_name)
            frame = frame.f_back
        seen.append((threading.current_thread().name, holding))

    for i in range(3):
        [t] = cudarecv.irecv(td, group=pg, group_src=0, bucket_bytes=64, return_premature=True)
        t.add_done_callback(look)
        set_flag(f"{key}_posted_{i}")
        t.wait(timeout=20)
    return seen, same(td, make("nested", 2.0))


def test_no_work_is_left_on_a_drivers_stack_when_its_transfer_ends(cluster):
    """A link's thread sets a receive's result with no gloo work left in its frames: the waiter may return and
    the interpreter exit at once, and a work freed on a daemon thread after that aborts the process (SIGABRT,
    "terminate called without an active exception": seen 3 times in 40 runs of a script that exits right after
    its last receive)."""
    _, (seen, ok) = cluster().run(works_on_the_drivers_stack, args=(unique_key("stack"),))
    assert ok and len(seen) == 3, seen
    assert all(name.startswith("cudarecv-recv-") for name, _ in seen), (
        seen
    )  # (set on the link's thread)
    assert all(not holding for _, holding in seen), seen


def two_receives_one_tag(rank, world, group, key):
    """Two receives with one init_tag posted at once on a fresh link, waited in order: the first transfer's
    offer (on the header's tag, right after the header) is the first receive's, not the second's."""
    pg = _group(rank, world, key)
    tds = [TensorDict(x=torch.full((4096,), float(k + 1 if rank == 0 else 0))) for k in range(2)]
    if rank == 0:
        sends = [
            cudarecv.isend(
                td, group=pg, group_dst=1, bucket_bytes=4096, timeout=10, return_early=True
            )[0]
            for td in tds
        ]
        for t in sends:
            t.wait()
        return [t.transport for t in sends]
    receives = [
        cudarecv.irecv(
            td, group=pg, group_src=0, bucket_bytes=4096, timeout=10, return_premature=True
        )[0]
        for td in tds
    ]
    for t in receives:
        t.wait()
    return [bool((td["x"] == k + 1).all()) for k, td in enumerate(tds)]


def test_two_receives_with_one_init_tag_on_a_fresh_link(cluster):
    routes, exact = cluster().run(two_receives_one_tag, args=(unique_key("one_tag"),), timeout=60)
    assert exact == [True, True] and routes == ["wire", "shared memory"], (exact, routes)


def _join_world(port: int, rank: int) -> object:
    import torch.distributed as dist

    signals = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=signals, rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    return signals


def sends_then_exits(port: int, transport: str) -> None:
    """Three sends, then a normal exit (the interpreter's end), as a script ends."""
    signals = _join_world(port, 0)
    td = TensorDict(x=torch.zeros(1 << 16))
    for k in range(3):
        td["x"].fill_(k + 1)
        cudarecv.send(td, 1, bucket_bytes=1 << 16, timeout=20, transport=transport)
    signals.set("sent", "1")


def receives_after_the_sender_left(port: int, transport: str, results: object) -> None:
    """Three receives; the third only once the sender's third send returned and its process ended (if its
    send returns before this receive is posted: else it waits for this receive, which is what it must do)."""
    signals = _join_world(port, 1)
    td = TensorDict(x=torch.zeros(1 << 16))
    got = []
    try:
        for k in range(3):
            if k == 2:
                try:
                    signals.wait(["sent"], timedelta(seconds=3))
                except Exception:  # noqa: BLE001 - the send waits for this receive: the sender is still there
                    pass
                else:
                    signals.wait(["gone"])
            cudarecv.recv(td, 0, bucket_bytes=1 << 16, timeout=10, transport=transport)
            got.append(bool((td["x"] == k + 1).all()))
        results.put(got)
    except cudarecv.Error as error:
        results.put(f"{type(error).__name__}: {error}")


@pytest.mark.parametrize("transport", ["wire", "auto"])
def test_a_completed_send_survives_its_senders_exit(transport):
    """A send that returned: its receiver gets the bytes even if the sending process exits right after."""
    import multiprocessing as mp

    import torch.distributed as dist

    signals = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sender = ctx.Process(target=sends_then_exits, args=(signals.port, transport), daemon=True)
    receiver = ctx.Process(
        target=receives_after_the_sender_left, args=(signals.port, transport, results), daemon=True
    )
    sender.start(), receiver.start()
    try:
        sender.join(90)
        assert sender.exitcode == 0, f"the sender ended with {sender.exitcode}"
        signals.set("gone", "1")
        got = results.get(timeout=60)
    finally:
        for p in (sender, receiver):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert got == [True, True, True], got


def sends_to_a_dead_receiver(rank, world, group, key):
    """The receiver dies before it takes any offer; each of the sender's sends on the link fails (each a new
    offer of segments): none leaves a segment's descriptor behind."""
    import select

    pg = _group(rank, world, key)
    if rank == 1:
        # dies once rank 0 has formed the group too (dead during it, rank 0's connect fails, not its sends)
        wait_flag(f"{key}_formed", 60)
        store().set(f"{key}_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    set_flag(f"{key}_formed")
    try:
        pidfd = os.pidfd_open(int(store().get(f"{key}_pid")))
    except ProcessLookupError:  # (gone and reaped already)
        pass
    else:
        try:
            assert select.select([pidfd], [], [], 60)[0], (
                "the receiver did not die"
            )  # readable once it is gone
        finally:
            os.close(pidfd)
    before, kinds = _memfds(), []
    for _ in range(3):
        td = TensorDict(
            x=torch.zeros(1 << 16)
        )  # a new one each time: a failed one is refused on the link
        with pytest.raises(cudarecv.LinkError) as error:
            cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1 << 16, timeout=5)
        kinds.append(type(error.value).__name__)
    import gc

    gc.collect()
    return before, _memfds(), kinds


def test_failed_sends_to_a_dead_receiver_leave_no_descriptor():
    with Cluster(2, pg_timeout=20.0) as ranks:
        (before, after, kinds), _ = ranks.run(
            sends_to_a_dead_receiver, args=(unique_key("dead"),), may_die={1}, timeout=90
        )
    assert set(kinds) <= {"PeerError", "TransferTimeout"}, kinds
    assert before == after == 0, f"{after - before} memfd descriptors left by 3 failed sends"
