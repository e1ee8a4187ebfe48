"""Weight sync's transport seam (cudarecv.weights.transports): the registry picks the transport each case of the
old route tests picked, each transport says what it can do, and a transport registered from outside the library
(here: a fake wrapping the wire) carries a real sender/receiver pair's versions with no other change."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.core.link import Link
from cudarecv.samehost import cuda_ipc
from cudarecv.samehost import shared_memory as host
from cudarecv.weights.schema import Schema
from cudarecv.weights.snapshots import Snapshot
from cudarecv.weights.transports import registry
from cudarecv.weights.transports.base import Need
from cudarecv.weights.transports.wire import GLOO, NCCL, Wire, rules
from rawwire import store, unique_key

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@dataclasses.dataclass(frozen=True)
class Case:
    device: torch.device
    backends: tuple[str, ...]
    expected: str
    elastic: bool = False
    fanout: str = "auto"
    shareable: bool = True  # transport="auto" (not "wire", nor CUDARECV_TRANSPORT=wire)
    host_ok: bool = True  # anonymous shared segments work here
    ipc_ok: bool = True  # CUDA IPC exports work here


CASES = {
    "host weights, gloo: shared memory": Case(CPU, ("gloo",), "shared memory"),
    "host weights, star": Case(CPU, ("gloo",), "shared memory", fanout="star"),
    "host weights, one gloo link among NCCL ones": Case(CPU, ("nccl", "gloo"), "shared memory"),
    "host weights, NCCL only: the host offer travels on gloo": Case(CPU, ("nccl",), "wire"),
    "host weights, receivers joining by store": Case(CPU, (), "shared memory", elastic=True),
    "host weights, relay: a chain moves payloads": Case(CPU, ("gloo",), "wire", fanout="relay"),
    "host weights, transport='wire'": Case(CPU, ("gloo",), "wire", shareable=False),
    "host weights, no shared segments here": Case(CPU, ("gloo",), "wire", host_ok=False),
    "GPU weights, NCCL: CUDA IPC": Case(GPU, ("nccl",), "cuda ipc"),
    "GPU weights, gloo: CUDA IPC": Case(GPU, ("gloo",), "cuda ipc"),
    "GPU weights, by store": Case(GPU, (), "cuda ipc", elastic=True),
    "GPU weights, relay": Case(GPU, ("nccl",), "wire", fanout="relay"),
    "GPU weights, transport='wire'": Case(GPU, ("nccl",), "wire", shareable=False),
    "GPU weights, no CUDA IPC here": Case(GPU, ("nccl",), "wire", ipc_ok=False),
    "GPU weights never go to host segments": Case(GPU, ("gloo",), "wire", ipc_ok=False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_registry_chooses_the_transport_the_old_route_tests_chose(monkeypatch, case):
    monkeypatch.setattr(host, "available", lambda: None if case.host_ok else "no memfd here")
    monkeypatch.setattr(
        cuda_ipc, "available", lambda device: None if case.ipc_ok else "no CUDA IPC here"
    )
    need = Need(case.device, case.backends, case.elastic, case.fanout, case.shareable)
    assert registry.choose(need).name == case.expected


# what each transport can do: the answers of the old tests of its kind, one row each
CAPABILITIES = {
    #                header_only, sync_snapshots, zero_copy, stamped (written again after a drop), host_memory
    "wire": (False, 1, False, False, False),
    "shared memory": (True, 3, True, True, True),
    "cuda ipc": (True, 1, False, False, False),
}


@pytest.mark.parametrize("name", CAPABILITIES)
def test_each_transport_says_what_it_can_do(name):
    transport = next(t for t in registry.registered() if t.name == name)
    got = (
        transport.header_only,
        transport.sync_snapshots,
        transport.zero_copy,
        transport.stamped,
        transport.host_memory,
    )
    assert got == CAPABILITIES[name]
    # the handshake's offer: host segments on gloo links only, CUDA IPC on any link
    assert transport.offered_on("gloo")
    assert transport.offered_on("nccl") == (name != "shared memory")


def test_a_snapshot_the_sender_replaced_goes_on_the_wire():
    """A header-only transport carries a snapshot in one of its segments only: the sender's own storage (a
    replacement) goes on the wire, whatever the receiver took."""
    schema = Schema.of([("w",)], [torch.zeros(4)], False)
    own = Snapshot(schema, 16, CPU)
    in_segment = Snapshot(schema, 16, CPU, (0, host.Segment(schema.total)))
    for transport in registry.registered():
        assert transport.carries(own) == (not transport.header_only)
        assert transport.carries(in_segment)


def test_a_receiver_takes_the_offer_of_the_transport_that_made_it():
    segment = host.Segment(64)
    host_offer = host.offer([segment])
    segment.close_fd()
    device_offer = host.seal_offer(
        cuda_ipc.OFFER, cuda_ipc.KIND, [(b"h" * 64, b"e" * 64, 64, 0, b"0000:65:00.0")]
    )
    assert registry.accepting(host_offer).name == "shared memory"
    assert registry.accepting(device_offer).name == "cuda ipc"
    assert registry.most_offer_bytes() >= max(len(host_offer), len(device_offer))


def test_the_link_beneath_decides_standing_receives_and_latest_mode():
    assert rules(Link(None, 1, True, "gloo")) is GLOO
    assert rules(Link(None, 1, True, "nccl")) is NCCL
    assert GLOO.standing and GLOO.latest
    assert not NCCL.standing and not NCCL.latest  # a receive left posted blocks the pair's sends


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(Wire())


class Relabelled(Wire):
    """A transport from outside the library: the wire under another name, chosen before every other for host
    weights, offering a token of its own at the handshake; it counts what it did in this process."""

    name = "test wire"
    priority = 100
    OFFER = b"test-wire offer"

    def __init__(self) -> None:
        self.pushes = self.mapped = 0

    def usable(self, need: Need) -> bool:
        return need.device.type == "cpu"

    def takes(self, offer: bytes) -> bool:
        return offer == self.OFFER

    def offer(self, segments: list) -> bytes:
        return self.OFFER

    def map(self, offer: bytes, total: int, device: torch.device | None) -> list:
        self.mapped += 1
        return []

    def push(self, lane, snapshot, tags):
        self.pushes += 1
        return (yield from super().push(lane, snapshot, tags))


def through_a_registered_transport(rank, world, group, mode, key):
    """A plain sender and receiver on gloo, with one more transport registered in both processes (one line):
    every version goes through it, exact."""
    relabelled = Relabelled()
    registry.register(relabelled)  # the one line that adds a transport
    try:
        td = TensorDict(w=torch.zeros(1000), b=TensorDict(c=torch.zeros(10, dtype=torch.int64)))
        if rank == 0:
            with cudarecv.WeightSender(td, dst=[1], mode=mode, timeout=20) as sender:
                transports = sender.transports  # (the receiver says BYE after its last pull)
                for version in (1, 2, 3):
                    td["w"].fill_(version)
                    td["b", "c"].fill_(version)
                    sender.push()
                    # latest mode: the receiver pulls each version (else it skips to the newest)
                    if mode == "latest":
                        store().wait([f"{key}_{version}"])
            return transports, relabelled.pushes
        with cudarecv.WeightReceiver(src=0, timeout=20) as receiver:
            exact = True
            for version in (1, 2, 3):
                got = receiver.pull()
                exact &= got == version and bool(
                    (receiver.td["w"] == version).all() and (receiver.td["b", "c"] == version).all()
                )
                if mode == "latest":
                    store().set(f"{key}_{version}", "1")
            return receiver.transport, relabelled.mapped, exact
    finally:
        registry.unregister(relabelled.name)


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_a_transport_registered_from_outside_carries_a_real_pair(cluster, mode):
    (transports, pushes), (transport, mapped, exact) = cluster().run(
        through_a_registered_transport, args=(mode, unique_key("t")), timeout=60
    )
    assert transports == {1: "test wire"} and transport == "test wire"
    assert pushes == 3 and mapped == 1
    assert exact
