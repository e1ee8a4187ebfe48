"""Nothing outlives ``close()``: cudarecv's threads, descriptors, mappings and references to the user's
tensordicts and process groups, on every transport (the wire, shared memory), with real spawned ranks."""

from __future__ import annotations

import gc
import logging
import math
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from held import both_done, many_transfers, resources, transfers, weights_and_transfers
from rawwire import unique_key

TRANSPORTS = ["wire", "auto"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nothing_outlives_close_and_destroy(cluster, transport):
    """The link's threads end with its group; an idle driver holds neither the group nor a tensordict."""
    (_, _, _, sender, sender_alive, sent), (_, exact, _, receiver, receiver_alive, carried) = (
        cluster().run(
            weights_and_transfers, args=(transport, 0, unique_key("outlive")), timeout=120
        )
    )
    assert exact
    # weight sync's transport is its own default (shared memory on one host, sync and latest); a link's first
    # transfer goes on the wire, carrying the same-host offer
    assert (
        sent == ["shared memory"] * 2
        and carried
        == ["shared memory"] * 2
        + ["wire"]
        + ["wire" if transport == "wire" else "shared memory"] * 3
    ), (sent, carried)
    left = (sender, receiver, sender_alive, receiver_alive)
    assert left == ([], [], [False] * 4, [False] * 4), (
        left
    )  # (threads; weights, good, wrong, group)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refused_receives_leave_no_thread_behind(cluster, transport):
    """Three receives refused with HeaderError (each ends on the link's thread, which goes on): one thread
    per link direction, not one per failed receive."""
    (_, _, sender, _, _, _), (refused, exact, receiver, _, _, carried) = cluster().run(
        weights_and_transfers, args=(transport, 3, unique_key("refused")), timeout=120
    )
    assert refused == 3 and exact
    assert carried[2:] == ["wire" if transport == "wire" else "shared memory"], (
        carried
    )  # (taken after 3 refused)
    assert [name.split("#")[0] for name in receiver] == ["cudarecv-recv-0"], receiver
    assert [name.split("#")[0] for name in sender] == (
        [] if transport == "wire" else ["cudarecv-send-1"]
    ), sender


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refused_receives_outlive_nothing(cluster, transport):
    """A failed transfer's error, kept in torch's C++ future (which gc cannot see into), holds no frame: one
    would keep the transfer, its tensordict and its group alive for good."""
    (*_, sender, sender_alive, _), (*_, receiver, receiver_alive, _) = cluster().run(
        weights_and_transfers, args=(transport, 3, unique_key("refused")), timeout=120
    )
    left = (sender, receiver, sender_alive, receiver_alive)
    assert left == ([], [], [False] * 4, [False] * 4), left


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_transfers_with_refusals_keep_resources_flat(cluster, transport):
    results = cluster().run(many_transfers, args=(transport, unique_key("many")), timeout=300)
    assert results[1][0] == 250
    for rank, (_, early, late) in enumerate(results):
        assert early == late, (
            f"rank {rank}: (cudarecv threads, threads, descriptors, shared mappings) {early} after 20, {late} after 1000"
        )


def test_a_job_that_raises_is_logged_and_the_driver_goes_on(caplog):
    from cudarecv.core.driver import Driver

    ran = threading.Event()

    def bug() -> None:
        raise KeyError("a bug in a background job")

    driver = Driver("cudarecv-test-driver")
    with caplog.at_level(logging.ERROR, logger="cudarecv"):
        driver.submit(bug)
        driver.submit(ran.set)
        assert ran.wait(10), "the driver stopped after a job raised"
        driver.stop(10)
    assert not driver.thread.is_alive()
    [record] = [r for r in caplog.records if r.name == "cudarecv"]
    assert "cudarecv-test-driver" in record.getMessage() and record.exc_info[0] is KeyError


def logged_choices(rank, world, group, transport, key):
    """What the cudarecv logger says about a new link's transport, on each side (the same-host transport's
    records: other modules log their own choices)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: (
        records.append(record.getMessage()) if record.module == "policy" else None
    )
    log = logging.getLogger("cudarecv")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        pg = dist.new_group([0, 1], backend="gloo")
        td = TensorDict(x=torch.full((4096,), 1.0 + rank))
        transfers(rank, pg, [td] * 3, td, transport)
        both_done(key, rank)
        dist.destroy_process_group(pg)
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    return records


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_transport_of_each_link_is_logged_with_its_reason(cluster, transport):
    sender, receiver = cluster().run(logged_choices, args=(transport, unique_key("logged")))
    if transport == "wire":
        assert sender == [
            "sending to rank 1 of a gloo group: wire (the call's `transport` is 'wire', "
            "CUDARECV_TRANSPORT='auto')"
        ], sender
        assert receiver == [], receiver  # (nothing was offered)
    else:
        assert sender == [
            "sending to rank 1 of a gloo group: shared memory (the receiver took the offer; "
            "segments)"
        ], sender
        assert receiver == [
            "receiving from rank 0 of a gloo group: shared memory (took the host offer)"
        ], receiver


def test_a_tensordict_refused_on_a_link_does_not_keep_its_group():
    """A tensordict refused on a link after a failure holds that link's group weakly: the group goes once
    dropped, and a new group (perhaps at the same address) is not refused."""
    from cudarecv.core import stuck
    from cudarecv.core.link import Link

    def group() -> object:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)

    td = TensorDict(x=torch.zeros(3))
    link = Link(group(), 1, False, "gloo")
    stuck.mark(td, link, "it timed out", tags=range(5, 9), sending=True)
    with pytest.raises(cudarecv.LinkError, match="it timed out"):
        stuck.check(td, link)
    with pytest.raises(cudarecv.LinkError, match="send to rank 1 on tag 8 failed"):
        stuck.check(TensorDict(), link, range(8, 10), sending=True)
    stuck.check(TensorDict(), link, range(8, 10), sending=False)  # (the other direction)
    stuck.check(TensorDict(), link, (4, 9), sending=True)
    gone = weakref.ref(link.pg)
    del link
    gc.collect()
    assert gone() is None, "the refusal keeps the group alive"
    fresh = Link(group(), 1, False, "gloo")
    stuck.check(td, fresh, range(5, 9), sending=True)


# -- arguments refused at once, by name -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e10, -math.inf])
def test_timeouts_out_of_range_are_refused_by_name_before_anything_is_sent(bad):
    """(no process group here: each is refused before a link is resolved)"""
    td = TensorDict(x=torch.zeros(3))
    calls = [
        lambda: cudarecv.send(td, 1, timeout=bad),
        lambda: cudarecv.recv(td, 0, timeout=bad),
        lambda: cudarecv.isend(td, 1, timeout=bad, bucket_bytes=64),
        lambda: cudarecv.irecv(td, 0, timeout=bad, bucket_bytes=64),
        lambda: cudarecv.WeightSender(td, dst=1, timeout=bad),
    ]
    for call in calls:
        with pytest.raises(
            cudarecv.ArgumentError,
            match=r"`timeout` must be a positive number of seconds up to 1e\+06",
        ):
            call()


@pytest.mark.parametrize(
    "dst", [[[1], 2], np.array([1]), [1, True], "1"], ids=["nested", "ndarray", "bool", "str"]
)
def test_bad_ranks_are_refused_by_name(dst):
    td = TensorDict(x=torch.zeros(3))
    with pytest.raises(cudarecv.ArgumentTypeError, match="`dst` must be an int rank"):
        cudarecv.WeightSender(td, dst=dst)


def test_a_transport_that_is_no_string_is_refused():
    td = TensorDict(x=torch.zeros(3))
    for call in (
        lambda: cudarecv.send(td, 1, bucket_bytes=64, transport=np.array(["wire"])),
        lambda: cudarecv.WeightSender(td, dst=1, transport=np.array(["wire"])),
    ):
        with pytest.raises(cudarecv.ArgumentError, match="`transport` must be one of"):
            call()


def refused_by_the_environment(rank, world, group, variable, value):
    """A receiver whose environment is wrong refuses to start: its sender hears it at once."""
    if rank == 0:
        with pytest.raises(cudarecv.ReceiverFailed) as error:
            cudarecv.WeightSender(TensorDict(x=torch.zeros(3)), dst=1, timeout=20)
        return str(error.value)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, value)  # this process alone
        with pytest.raises(cudarecv.ArgumentError) as error:
            cudarecv.WeightReceiver(src=0, timeout=20)
    return str(error.value)


@pytest.mark.parametrize(
    "variable, value", [("CUDARECV_TRANSPORT", "shm"), ("CUDARECV_DIRECT_READ", "maybe")]
)
def test_a_receivers_bad_environment_reaches_its_sender(cluster, variable, value):
    sender, receiver = cluster().run(refused_by_the_environment, args=(variable, value), timeout=60)
    assert f"{variable}='{value}'" in receiver and f"{variable}='{value}'" in sender, (
        sender,
        receiver,
    )


def groups_used_then_dropped(rank, world, group, transport, count, key):
    """``count`` new groups, each used for a few fast-wire transfers, then destroyed and dropped (the README's
    recovery after a LinkError): threads and descriptors after the first two and after all."""
    good = TensorDict(x=torch.full((4096,), 1.0 + rank))
    seen = []
    for n in range(count):
        pg = dist.new_group([0, 1], backend="gloo")
        transfers(rank, pg, [good] * 3, good, transport)
        both_done(f"{key}_{n}", rank)
        dist.destroy_process_group(pg)
        del pg
        if n in (1, count - 1):
            seen.append(resources()[1:3])
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_groups_used_then_dropped_leave_nothing(cluster, transport):
    results = cluster().run(
        groups_used_then_dropped, args=(transport, 12, unique_key("groups")), timeout=300
    )
    for rank, (early, late) in enumerate(results):
        assert early == late, (
            f"rank {rank}: (threads, descriptors) {early} after 2 groups, {late} after 12"
        )
