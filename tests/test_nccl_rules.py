"""cudarecv's NCCL protocol paths, run on the CPU through a strict stand-in of NCCL's matching rules.

:class:`cudarecv.testing.strict_nccl.StrictNccl` matches point-to-point ops by communicator and posting
order (never by tag), puts single ops on the pair's communicator and batched ones on the group's, makes
the group's communicator only once every rank of the group batched, refuses coalescing from two threads
and bounds every wait: what hangs or moves garbage on GPUs fails here, naming the rule. Each rank stands
the CPU in for CUDA, its tensors as device memory or as host memory (staged through "device" buffers).
The real NCCL tests (``tests/test_gpu.py``) are kept for GPU machines.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.core import transport
from cudarecv.core.link import Link
from cudarecv.testing.launch import Ranks
from cudarecv.testing.strict_nccl import NcclRuleError, StrictNccl, stand_in_cuda
from policies import holds_version, policy, set_version
from rawwire import store, unique_key

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def three():
    ranks = Ranks(3, pg_timeout=60.0)
    yield ranks
    ranks.close()


def _outcome(call):
    try:
        return "ok", call()
    except NcclRuleError as error:
        return "NcclRuleError", str(error)
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def _td(fill: float, consolidated: bool) -> TensorDict:
    td = TensorDict(
        a=torch.full((3000,), fill),
        b=torch.arange(77, dtype=torch.float64) + fill,
        c=TensorDict(d=torch.full((5, 7), -fill), batch_size=[]),
        batch_size=[],
    )
    return td.consolidate(metadata=True) if consolidated else td


def _same(td: TensorDict, fill: float) -> bool:
    want = _td(fill, False)
    return all(torch.equal(td.get(k), want.get(k)) for k in want.keys(True, True))


MODES = {  # mode: (consolidated, bucket_bytes)
    "per-leaf": (False, None),
    "consolidated": (True, None),
    "buckets": (False, 4096),
    "chunks": (True, 4096),
}


def transfers(rank, world, group, key, mode, memory):
    """Three transfers of one tensordict, rank 0 to rank 1, each rank's memory as given."""
    consolidated, bucket_bytes = MODES[mode]
    kw = dict(consolidated=consolidated, bucket_bytes=bucket_bytes, timeout=TIMEOUT)
    with stand_in_cuda(memory[rank]):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)

        def run():
            seen = []
            for step in range(3):
                td = _td(float(step + 1) if rank == 0 else 0.0, consolidated)
                if rank == 0:
                    cudarecv.send(td, group=pg, group_dst=1, **kw)
                else:
                    cudarecv.recv(td, group=pg, group_src=0, **kw)
                    seen.append(_same(td, float(step + 1)))
            return seen

        return _outcome(run), sorted({op[0] for op in pg.ops})


@pytest.mark.parametrize(
    "memory",
    [("device", "device"), ("device", "host"), ("host", "device")],
    ids=["device-device", "device-host", "host-device"],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_transfer_matches_on_one_communicator(cluster, mode, memory):
    """Whatever each end's memory (device memory: posted in place, batched; host memory: staged message by
    message), both ends post on the same communicator in the same order: every value exact."""
    (sent, comms0), (got, comms1) = cluster().run(
        transfers, args=(unique_key(f"t-{mode}"), mode, memory), timeout=4 * TIMEOUT
    )
    assert sent[0] == "ok", sent
    assert got == ("ok", [True, True, True]), got
    assert comms0 == comms1, (comms0, comms1)


def drained(rank, world, group, key, memory):
    """A fast-wire receive whose header does not match drains the payload, then the next transfer goes."""
    with stand_in_cuda(memory[rank]):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        kw = dict(bucket_bytes=1024, timeout=TIMEOUT)
        if rank == 0:
            return [
                _outcome(lambda td=td: cudarecv.send(td, group=pg, group_dst=1, **kw))
                for td in (_td(1.0, False), _td(2.0, False))
            ]
        other = TensorDict(z=torch.zeros(999), batch_size=[])
        first = _outcome(lambda: cudarecv.recv(other, group=pg, group_src=0, **kw))
        td = _td(0.0, False)
        second = _outcome(lambda: cudarecv.recv(td, group=pg, group_src=0, **kw))
        return first[0], second[0], _same(td, 2.0)


@pytest.mark.parametrize(
    "memory", [("device", "device"), ("device", "host")], ids=["device", "host"]
)
def test_a_mismatched_payload_is_drained_on_the_senders_communicator(cluster, memory):
    sent, got = cluster().run(drained, args=(unique_key("drain"), memory), timeout=4 * TIMEOUT)
    assert got == ("HeaderError", "ok", True), got
    assert [s[0] for s in sent] == ["ok", "ok"], sent


def out_of_order(rank, world, group, key):
    """NCCL ignores tags: two fast-wire transfers with different init_tags, received in the other order."""
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        kw = dict(bucket_bytes=4096, timeout=TIMEOUT)
        if rank == 0:
            a, b = _td(1.0, False), _td(2.0, False)
            return [
                _outcome(lambda: cudarecv.send(a, group=pg, group_dst=1, init_tag=1, **kw)),
                _outcome(lambda: cudarecv.send(b, group=pg, group_dst=1, init_tag=2, **kw)),
            ]
        b = _td(0.0, False)
        return _outcome(lambda: cudarecv.recv(b, group=pg, group_src=0, init_tag=2, **kw))


def test_receives_out_of_the_senders_order_are_refused_on_nccl(cluster):
    """Matched by order, the receive of init_tag 2 would take init_tag 1's header and payload (the same
    layout: the values silently swapped); it is refused, naming the order."""
    _, got = cluster().run(out_of_order, args=(unique_key("order"),), timeout=4 * TIMEOUT)
    assert got[0] == "OutOfStepError" and "init_tag 1" in got[1] and "order" in got[1], got


def weight_sync(rank, world, group, key, fanout, memory):
    """Weight sync over the strict group: a star to two receivers, or a relay chain 1 -> 2."""
    model = policy()
    with stand_in_cuda(memory[rank]):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        if rank == 0:

            def push_all():
                with cudarecv.WeightSender(
                    TensorDict.from_module(model),
                    group=pg,
                    group_dst=[1, 2],
                    bucket_bytes=1024,
                    timeout=TIMEOUT,
                    fanout=fanout,
                ) as sender:
                    for version in (1, 2, 3):
                        set_version(model, version)
                        sender.push()
                    return sender.fanout

            return _outcome(push_all)

        def pull_all():
            with cudarecv.WeightReceiver(
                group=pg, group_src=0, expect=model, timeout=TIMEOUT
            ) as receiver:
                held = []
                for _ in range(3):
                    version = receiver.pull()
                    held.append(holds_version(receiver.td, version))
                return held

        return _outcome(pull_all)


@pytest.mark.parametrize(
    "memory",
    [("device", "device", "device"), ("device", "host", "device")],
    ids=["device", "mixed"],
)
@pytest.mark.parametrize("fanout", ["star", "relay"])
def test_weight_sync_over_nccl_rules(three, fanout, memory):
    """The handshake, every push and the relay's forwarding post on communicators both ends agree on: the
    group's is made by all three ranks, no two threads coalesce at once."""
    results = three().run(
        weight_sync, args=(unique_key(f"w-{fanout}"), fanout, memory), timeout=6 * TIMEOUT
    )
    assert results[0] == ("ok", fanout), results
    assert results[1:] == [("ok", [True, True, True])] * 2, results


def coalescing_rules(rank, world, group, key):
    """The stand-in itself: a batch from a second thread, and a first batch that not every rank makes."""
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=2.0, name=key)
        out = {}
        if rank == 0:  # ranks 1 and 2 never batch: the group's communicator is never made
            out["first batch"] = _outcome(pg._start_coalescing)[0]
            pg._group_ready = True  # (past that rule, for the next ones)
            pg._start_coalescing()
            caught = []
            thread = threading.Thread(target=lambda: caught.append(_outcome(pg._start_coalescing)))
            thread.start()
            thread.join(10)
            out["second thread"] = caught[0][0]
            pg._end_coalescing()
            try:
                pg._start_coalescing(torch.device("cpu"))
                out["takes a device"] = True
            except TypeError:
                out["takes a device"] = False
        return out


def test_the_stand_in_enforces_what_it_promises(three):
    """(The rules the NCCL tests lean on, shown to bite: another thread's coalescing, a first batch that
    rank 2 never joins, and a backend's coalescing that takes no device.)"""
    out = three().run(coalescing_rules, args=(unique_key("rules"),), timeout=60)[0]
    assert out["first batch"] == "NcclRuleError", out
    assert out["second thread"] == "NcclRuleError", out
    assert out["takes a device"] is False, out


def _blocked_in_coalesced(thread: threading.Thread) -> bool:
    """``thread`` waits for the group's coalescing lock: its innermost Python frame is ``_coalesced`` at the
    line that takes the lock (the acquire itself is C)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None or frame.f_code is not transport._coalesced.__code__:
        return False
    return (
        linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        .strip()
        .startswith("with _coalescing(")
    )


def concurrent_batches(rank, world, group, key):
    """Two threads of rank 0 post a batch each on one group (NCCL item 4): the second thread's batch waits for
    the first's (it would otherwise start coalescing inside it) and both arrive, in order, on rank 1."""
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        link = Link(pg, 1 - rank, False)
        if rank == 1:
            got = [torch.zeros(64), torch.zeros(64)]
            for t in got:
                [work] = transport.post(link, False, [t], [7], batch=True)
                work.wait()
            return [t.unique().tolist() for t in got]
        inside, running, outcomes = threading.Event(), threading.Event(), {}
        send = pg.send

        def send_holding(
            tensors, dst, tag=0
        ):  # the first thread stays inside its batch until the second waits
            if threading.current_thread().name == "first" and not inside.is_set():
                inside.set()
                assert running.wait(TIMEOUT)
                for _ in range(int(TIMEOUT / 0.01)):
                    if "second" in outcomes or _blocked_in_coalesced(second):
                        break
                    time.sleep(
                        0.01
                    )  # (a poll for the other thread's state, bounded; no ordering rests on it)
            return send(tensors, dst, tag)

        pg.send = send_holding

        def batch(name, fill):
            if name == "second":
                running.set()
            try:
                for work in transport.post(link, True, [torch.full((64,), fill)], [7], batch=True):
                    work.wait()
                outcomes[name] = "ok"
            except NcclRuleError as error:
                outcomes[name] = f"NcclRuleError: {error}"

        first = threading.Thread(target=batch, args=("first", 1.0), name="first")
        second = threading.Thread(target=batch, args=("second", 2.0), name="second")
        first.start()
        assert inside.wait(TIMEOUT)
        second.start()
        for thread in (first, second):
            thread.join(2 * TIMEOUT)
        return outcomes


def test_batches_from_two_threads_on_one_group_wait_for_each_other(cluster):
    """(NCCL item 4: torch's coalescing state is one per group; before the per-group lock the second thread's
    ``_start_coalescing`` ran inside the first's batch, which the stand-in refuses.)"""
    sent, got = cluster().run(
        concurrent_batches, args=(unique_key("threads"),), timeout=4 * TIMEOUT
    )
    assert sent == {"first": "ok", "second": "ok"}, sent
    assert got == [[1.0], [2.0]], got


# -- NCCL's streams (issue 47: a stream per link, eager initialisation) ---------------------------------------
# With ``streams=True`` the stand-in runs each op on its communicator's stream after what its posting stream
# waited for, a send only once its peer's stream reached the receive (a large message), and refuses an op
# whose stream waits for a pending op with another peer (cudarecv.testing.strict_streams).

STALL = 2 * TIMEOUT  # the longest a stalled receiver waits for the others (then it pulls anyway)


@pytest.fixture(scope="module")
def fresh_three():
    """Three ranks of their own for the streams tests (none of the other tests' objects in their processes)."""
    ranks = Ranks(3, pg_timeout=60.0)
    yield ranks
    ranks.close()


def stalled_sync(rank, world, group, key, fanout, eager, stalled, memory="device"):
    """A sender (rank 0) pushes one version to ranks 1 and 2 (a star, or a relay 1 -> 2). Rank ``stalled``
    pulls only once the other receiver has the version (or after ``STALL`` s): a stalled receiver must not
    stall the other. Each rank says its outcome; the sender also the unneeded waits the stand-in found.
    ``memory``: every rank's tensors count as device memory, or as host memory (staged through device
    buffers and copy streams on NCCL)."""
    model = policy()
    with stand_in_cuda(memory, streams=True):
        # (eagerly: registered, as a group made with device_id= is; cudarecv forms its pair groups on its store)
        pg = StrictNccl(
            store(),
            rank,
            world,
            timeout=TIMEOUT,
            name=key,
            streams=True,
            eager=eager,
            registered=eager,
        )
        if rank == 0:

            def push_all():
                with cudarecv.WeightSender(
                    TensorDict.from_module(model),
                    group=pg,
                    group_dst=[1, 2],
                    bucket_bytes=256,  # a handful of chunks per version
                    timeout=TIMEOUT,
                    fanout=fanout,
                ) as sender:
                    for version in (1, 2):
                        set_version(model, version)
                        sender.push()
                    torch.cuda.synchronize()  # (every op posted has run: its failure is raised here)
                    return sender.fanout

            return _outcome(push_all), pg.violations

        def pull_all():
            with cudarecv.WeightReceiver(
                group=pg, group_src=0, expect=model, timeout=TIMEOUT
            ) as receiver:
                held = []
                for step in (1, 2):
                    if (
                        rank == stalled
                    ):  # (the other's signal, bounded: a test of order, not of time)
                        with contextlib.suppress(Exception):
                            store().wait([f"{key}/got/{step}"], timedelta(seconds=STALL))
                    version = receiver.pull()
                    # (the host reads what the pull received: its stream's work, not the forwards still going)
                    torch.cuda.current_stream().synchronize()
                    store().set(f"{key}/got/{step}", "1")
                    held.append(holds_version(receiver.td, version))
                return held

        return _outcome(pull_all), pg.violations


@pytest.mark.parametrize(
    "fanout, stalled, eager",
    [("star", 1, False), ("star", 2, False), ("relay", 2, False), ("star", 1, True)],
    ids=["star-1", "star-2", "relay-tail", "star-1-eager"],
)
def test_a_stalled_receiver_does_not_stall_the_others(fresh_three, fanout, stalled, eager):
    """Issue 47 item 1: every link of a weight end has a stream of its own, so nothing posted to one receiver
    waits for what is pending with another. (On one stream per device, shared by every link, the sender's
    ops to the other receiver were ordered after those to the stalled one: the stand-in refuses that edge.)
    Initialised eagerly (item 4), the links are pair groups of their own: the same."""
    results = fresh_three().run(
        stalled_sync,
        args=(unique_key(f"stall-{fanout}-{stalled}-{eager}"), fanout, eager, stalled),
        timeout=6 * TIMEOUT,
    )
    assert results[0] == (("ok", fanout), []), results
    assert [r[0] for r in results[1:]] == [("ok", [True, True])] * 2, results
    assert all(r[1] == [] for r in results), results


@pytest.mark.parametrize(
    "fanout, stalled",
    [("star", 1), ("star", 2), ("relay", 2)],
    ids=["star-1", "star-2", "relay-tail"],
)
def test_a_stalled_receiver_does_not_stall_the_others_through_host_staging(
    fresh_three, fanout, stalled
):
    """Issue 47 item 1 on host memory, which NCCL's ends stage through device buffers and copy streams (the
    stand-in's device memory, what is allocated with ``device=``, carries the control bytes as a GPU does).
    (The copy streams' own defect shows in
    ``test_a_links_staging_copies_do_not_wait_for_another_links_receive``.)"""
    results = fresh_three().run(
        stalled_sync,
        args=(unique_key(f"stall-host-{fanout}-{stalled}"), fanout, False, stalled, "host"),
        timeout=6 * TIMEOUT,
    )
    assert results[0] == (("ok", fanout), []), results
    assert [r[0] for r in results[1:]] == [("ok", [True, True])] * 2, results
    assert all(r[1] == [] for r in results), results


def test_a_relay_on_an_eagerly_initialised_group_forms_no_wait_cycle(fresh_three):
    """Issue 47 item 4: initialised eagerly (``device_id=``), torch runs every op of the group on its one
    communicator's stream, in posting order; a relay's sender waits there for the first receiver's word
    ahead of the second's header, which the first's forward waits for. cudarecv's weight ends talk over
    pair groups of their own there (cudarecv.wire.staging.pair_link): no cycle, every version lands."""
    results = fresh_three().run(
        stalled_sync,
        args=(unique_key("eager-relay"), "relay", True, -1),
        timeout=6 * TIMEOUT,
    )
    assert results[0] == (("ok", "relay"), []), results
    assert [r[0] for r in results[1:]] == [("ok", [True, True])] * 2, results


def stream_rules(rank, world, group, key, shared, eager):
    """The stand-in itself, on raw ops. Lazily: rank 0 sends to rank 1 (which receives only once told) and,
    while that is pending, to rank 2 (which receives at once), on one stream (``shared``) or two.
    Eagerly: a ring, each rank sending to the next and receiving from the one before, large messages on the
    group's one stream each: a wait cycle."""
    with stand_in_cuda("device", streams=True):
        pg = StrictNccl(store(), rank, world, timeout=3.0, name=key, streams=True, eager=eager)
        data = torch.full((4096,), float(rank))
        if eager:
            into = torch.zeros(4096)
            works = [pg.send([data], (rank + 1) % world), pg.recv([into], (rank - 1) % world)]
            try:
                for work in works:
                    work.wait()
                torch.cuda.synchronize()
                return "ok", into.unique().tolist()
            except NcclRuleError as error:
                return "NcclRuleError", str(error)
        if rank > 0:
            if rank == 1:
                store().wait([f"{key}/go"], timedelta(seconds=4 * TIMEOUT))
            into = torch.zeros(4096)

            def received():
                pg.recv([into], 0).wait()
                torch.cuda.synchronize()
                return into.unique().tolist()

            return _outcome(received)
        first = torch.cuda.Stream()
        second = first if shared else torch.cuda.Stream()
        with torch.cuda.stream(first):
            pg.send([data], 1).wait()  # `first` now waits for it: pending until rank 1 receives
        assert not first.query()
        try:
            with torch.cuda.stream(second):
                pg.send([data], 2).wait()
            outcome = ("ok", "")
        except NcclRuleError as error:
            outcome = ("NcclRuleError", str(error))
        finally:
            store().set(f"{key}/go", "1")
        torch.cuda.synchronize()
        return outcome, pg.violations


@pytest.mark.parametrize("shared", [True, False], ids=["one-stream", "a-stream-each"])
def test_the_stand_in_refuses_a_wait_for_another_peers_pending_op(fresh_three, shared):
    out = fresh_three().run(
        stream_rules, args=(unique_key(f"edges-{shared}"), shared, False), timeout=60
    )
    (outcome, violations), one, two = out
    if shared:
        assert outcome[0] == "NcclRuleError", out
        assert "send to rank 2" in outcome[1] and "send to rank 1" in outcome[1], out
        assert "must not wait for a pending op with another" in outcome[1], out
        assert violations == [outcome[1]], out
    else:
        assert outcome == ("ok", "") and violations == [], out
    assert one == ("ok", [0.0]), out
    if shared:  # (refused: never posted, so rank 2's receive times out)
        assert two[0] == "NcclRuleError" and "did not complete" in two[1], out
    else:
        assert two == ("ok", [0.0]), out


def test_the_stand_in_names_a_wait_cycle_of_an_eager_group(fresh_three):
    """Three ranks' rings of large messages on eagerly initialised groups: every rank's one stream waits in its
    send for the next rank's receive, queued behind that rank's own send. Each fails within the timeout and
    says where every rank's stream waits."""
    out = fresh_three().run(stream_rules, args=(unique_key("ring"), False, True), timeout=60)
    for kind, text in out:
        assert kind == "NcclRuleError", out
        assert "group stream" in text and "Where each rank's streams wait" in text, text


def _drive(protocol):
    """Run a staging sub-protocol to its end: the host waits for what each step yields."""
    for works in protocol:
        for work in works:
            work.wait()


def staged_receives(rank, world, group, key):
    """Host memory on NCCL, through device buffers and a copy stream. Rank 0 posts a receive from rank 1 (which
    sends only once told), then receives three messages from rank 2 (which sends at once) on a lane of its own:
    those copies and receives must not wait for the pending receive from rank 1."""
    from cudarecv.core.streams import StagingPool
    from cudarecv.wire.staging import lane_for, recv_into

    with stand_in_cuda("host", streams=True):
        pg = StrictNccl(store(), rank, world, timeout=3.0, name=key, streams=True)
        if rank > 0:
            if rank == 1:
                store().wait([f"{key}/go"], timedelta(seconds=4 * TIMEOUT))
            tags = [9] if rank == 1 else [1, 2, 3]
            works = [pg.send([torch.full((4096,), float(tag))], 0, tag) for tag in tags]
            return _outcome(lambda: [w.wait() for w in works] and torch.cuda.synchronize())

        def lane(peer):  # (a weight end's: a stream and a copy stream of the link's own)
            link = Link(pg, peer, False, "nccl")
            return lane_for(link, torch.device("cpu"), None, StagingPool(), peers_at_once=True)

        held = torch.zeros(4096)
        first = recv_into(lane(1), [held], [9])
        next(
            first
        )  # (every receive is posted in the first step: this one is pending until rank 1 sends)
        dests = [torch.zeros(4096) for _ in range(3)]
        try:
            _drive(recv_into(lane(2), dests, [1, 2, 3]))
            outcome = ("ok", [d.unique().tolist() for d in dests])
        except NcclRuleError as error:
            outcome = ("NcclRuleError", str(error))
        finally:
            store().set(f"{key}/go", "1")
        late = _outcome(lambda: _drive(first) or torch.cuda.synchronize() or held.unique().tolist())
        return outcome, late, pg.violations


def test_a_links_staging_copies_do_not_wait_for_another_links_receive(fresh_three):
    """Review of issue 47, item 2: host memory on NCCL is staged through device buffers, its copies on a copy
    stream that waits for the lane's stream. On one copy stream per device, shared by every link, the copies
    for rank 2 waited for the receive still pending from rank 1, and so did the receives from rank 2 that
    follow them (a stalled peer stalls the others; a receive never matched, every later staged transfer): the
    stand-in refuses that edge. A copy stream per link (``Lane.copier``) keeps the links apart."""
    (outcome, late, violations), one, two = fresh_three().run(
        staged_receives, args=(unique_key("staged-copies"),), timeout=6 * TIMEOUT
    )
    assert outcome == ("ok", [[1.0], [2.0], [3.0]]), (outcome, violations)
    assert late == ("ok", [9.0]) and violations == [], (late, violations)
    assert one[0] == "ok" and two[0] == "ok", (one, two)
