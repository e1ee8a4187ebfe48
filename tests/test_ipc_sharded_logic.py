"""Issue 47, items 6 and 7, checked without a GPU (their GPU checks: ``tests/test_gpu_ipc_sharded.py``).

6. CUDA IPC across the GPUs of a node: the memory of an IPC handle stays on the writer's GPU, and torch places a
   pointer on the device CUDA names for it (the writer's), copying it when asked for another device. A reader on
   another GPU opens the handle on the writer's GPU (named by PCI bus id: process numberings differ) and copies
   device to device, instead of declining the offer (the wire then carried every payload). Here cupy's runtime and
   torch's placement of a pointer are stood in by a model of what CUDA does.
7. A sharded pull into GPU buffers copies what did not land in place on its lanes' stream after what the ranks'
   pulls queued (stream waits) and publishes once that stream's event fired: never ``torch.cuda.synchronize``,
   which waits for every stream of the device (the caller's unrelated work too), nor the default stream. Run on
   spawned ranks over the strict NCCL stand-in, the receiver taking its CUDA path on CPU tensors.
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.samehost import cuda_ipc
from cudarecv.samehost.shared_memory import MappingError
from cudarecv.testing.strict_nccl import StrictNccl, stand_in_cuda
from rawwire import store, unique_key

TIMEOUT = 20.0

# -- 6: the reader of another GPU's memory --------------------------------------------------------------------

BUSES = {"0000:1a:00.0": 0, "0000:3b:00.0": 1}  # this process's GPUs, by PCI bus id


class _Node:
    """What CUDA does with IPC handles on a node of two GPUs, as cupy's runtime shows it: an allocation stays on
    the GPU it was made on; ``cudaIpcOpenMemHandle`` maps it in the context of the current GPU; torch places a
    pointer on the GPU it lies on (``cudaPointerGetAttributes``) and copies it when asked for another."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self) -> None:
        self.current = 0
        self.lies_on: dict[int, int] = {}  # pointer -> the GPU its memory is on
        self.opened: list[tuple[int, int]] = []  # (pointer, the GPU current when opened)
        self.closed: list[int] = []

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:  # noqa: N802 - cupy's name
        ptr = 0x7F0000000000 + 0x1000 * len(self.opened)
        self.lies_on[ptr] = int(handle.rstrip(b"\0").decode())  # (the handle says its GPU, here)
        self.opened.append((ptr, self.current))
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:  # noqa: N802
        self.closed.append(ptr)

    def deviceGetByPCIBusId(self, bus: str) -> int:  # noqa: N802
        if bus not in BUSES:
            raise RuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        return BUSES[bus]

    def device(self, device: object) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def current():
            before, self.current = self.current, torch.device(device).index
            try:
                yield
            finally:
                self.current = before

        return current()

    def as_tensor(self, obj: object, device: torch.device | None = None) -> object:
        ptr, nbytes = (
            obj.__cuda_array_interface__["data"][0],
            obj.__cuda_array_interface__["shape"][0],
        )
        where = torch.device("cuda", self.lies_on[ptr])
        if (
            device is not None and torch.device(device) != where
        ):  # torch copies it onto the device asked
            return types.SimpleNamespace(data_ptr=lambda: 0xC0FFEE, device=torch.device(device))
        return types.SimpleNamespace(data_ptr=lambda: ptr, device=where, nbytes=nbytes)


@pytest.fixture
def node(monkeypatch):
    """This process on a node of two GPUs (cupy's runtime and torch's pointer placement modelled)."""
    model = _Node()
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cupy.cuda, cuda.runtime = cuda, model
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(cuda_ipc, "available", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device", model.device)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(torch, "as_tensor", model.as_tensor)
    monkeypatch.setattr(
        torch.cuda.Event,
        "from_ipc_handle",
        staticmethod(lambda device, handle: types.SimpleNamespace(device=device)),
    )
    return model


def _offer(gpu: int, bus: str) -> bytes:
    """A writer's offer of two segments on its GPU ``gpu`` (its numbering), PCI bus ``bus``."""
    segment = types.SimpleNamespace(
        handle=str(gpu).encode(),
        event_handle=b"e",
        capacity=4096,
        device=torch.device("cuda", gpu),
        bus_id=bus.encode(),
    )
    return cuda_ipc.offer([segment, segment])


def test_a_reader_on_another_gpu_maps_the_writers_memory_where_it_lies(node):
    """The writer's segments are on cuda:0, the reader copies into cuda:1: each is opened on cuda:0 (as torch's
    CUDA tensor sharing does) and viewed there, never copied at mapping (a declined offer before)."""
    mappings = cuda_ipc.map_offer(_offer(0, "0000:1a:00.0"), 1 << 20, torch.device("cuda", 1))
    assert [(m.device, m.owner) for m in mappings] == [
        (torch.device("cuda", 1), torch.device("cuda", 0))
    ] * 2
    assert [gpu for _, gpu in node.opened] == [0, 0], "opened on another GPU than the memory's"
    assert [m.data.data_ptr() for m in mappings] == [ptr for ptr, _ in node.opened]
    assert all(m.data.device == torch.device("cuda", 0) for m in mappings)
    assert "device-to-device copies to cuda:1, peer to peer" in mappings[0].crossing


def test_the_writers_gpu_is_named_by_its_bus_not_its_number(node):
    """Numberings differ between processes (``CUDA_VISIBLE_DEVICES``): the writer's cuda:0 is this process's
    cuda:1 when its bus says so; a GPU this process cannot see is refused, naming it (the wire carries it)."""
    [mapping, _] = cuda_ipc.map_offer(
        _offer(1, "0000:3b:00.0"), 1 << 20, torch.device("cuda", 1)
    )  # writer's cuda:1 is ours too
    assert mapping.owner == mapping.device == torch.device("cuda", 1) and mapping.crossing is None
    with pytest.raises(MappingError, match=r"writer's GPU \(its cuda:0, PCI bus 0000:99:00.0\)"):
        cuda_ipc.map_offer(_offer(0, "0000:99:00.0"), 1 << 20, torch.device("cuda", 0))


class _Group:
    """A process group as the log of a link's choices keys it (weakly)."""


def test_a_receiver_on_another_gpu_takes_the_device_offer(node, caplog):
    """The route decision: a fast-wire receiver whose tensordict is on cuda:1 answers a sender's offer of cuda:0
    segments OK and reads the payloads through them (CUDA IPC), saying how the copies cross; before, it answered
    NO for good, and that link direction went on the wire."""
    from cudarecv.plan.header import Header, PayloadKind
    from cudarecv.samehost.channels import ChannelState
    from cudarecv.samehost.policy import DEVICE
    from cudarecv.samehost.records import Status, Word, read_back
    from cudarecv.samehost.recv_side import RecvSide
    from cudarecv.wire.fast import OFFER_SIZE

    posted: list[bytes] = []
    lane = types.SimpleNamespace(
        link=types.SimpleNamespace(pg=_Group(), peer=0, backend="gloo"),
        stream=types.SimpleNamespace(device=torch.device("cuda", 1)),
        device=torch.device("cuda", 1),
        nccl=False,
        post=lambda sending, tensors, tags: posted.append(tensors[0].numpy().tobytes()) or [],
    )
    side = RecvSide(0)
    raw = _offer(0, "0000:1a:00.0")
    with caplog.at_level("INFO", logger="cudarecv"):
        side.take_offer(
            lane,
            raw + bytes(OFFER_SIZE - len(raw)),
            True,
            Header(PayloadKind.BUCKETS, 0, 0, 1, b""),
        )
    channel = side.channels[DEVICE]
    state, owners = channel.state, [m.owner for m in channel.mappings]
    side.close()
    assert side.declined is None, side.declined
    assert [read_back(raw, Word.ANSWER, 0) for raw in posted] == [Status.OK]
    assert state is ChannelState.SHARED and owners == [torch.device("cuda", 0)] * 2
    assert "cuda ipc (took the device offer; the writer's memory is on cuda:0" in caplog.text


def test_copies_from_another_gpu_run_on_cudarecvs_stream_of_that_gpu(node, monkeypatch):
    """torch runs a device-to-device copy on the source GPU's current stream: while reading a mapping of another
    GPU that is cudarecv's dedicated stream there, never the default stream; the reader's stream waits for the
    writer's event first."""
    entered, waited = [], []

    def made_current(stream: object) -> contextlib.AbstractContextManager[None]:
        entered.append(stream)
        return contextlib.nullcontext()

    monkeypatch.setattr(cuda_ipc, "dedicated_stream", lambda device: f"dedicated:{device}")
    monkeypatch.setattr(torch.cuda, "stream", made_current)
    [mapping, _] = cuda_ipc.map_offer(_offer(0, "0000:1a:00.0"), 1 << 20, torch.device("cuda", 1))
    reader = types.SimpleNamespace(wait_event=waited.append)
    with mapping.reading(reader):
        pass
    assert waited == [mapping.written] and entered == ["dedicated:cuda:0"]


# -- 7: a sharded pull into GPU buffers --------------------------------------------------------------------------


def _sharded_pull(rank, world, group, key):
    """Rank 0 pushes two versions of plain weights (a one-rank trainer); rank 1 pulls them into "GPU" buffers (the
    CPU standing in), recording every device-wide synchronize, the stream each copy into its buffers ran on and
    the events: what the pull's tail queued and waited on."""
    weights = TensorDict(w=torch.zeros(64, 8), b=torch.zeros(8), steps=torch.zeros(3))
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        if rank == 0:
            with cudarecv.ShardedSender(
                weights, group=pg, group_dst=[1], timeout=TIMEOUT
            ) as sender:
                for version in (1, 2):
                    weights.apply_(lambda t, v=version: t.fill_(float(v)))
                    sender.push()
            return None
        log: list[tuple] = []
        current: list[object] = []
        stood_in_stream = torch.cuda.stream
        stood_in_event = torch.cuda.Event

        @contextlib.contextmanager
        def stream(s=None):
            current.append(s)
            try:
                with stood_in_stream(s):
                    yield
            finally:
                current.pop()

        class Event(stood_in_event):
            def record(self, stream=None):
                log.append(("record", id(self), stream))

            def synchronize(self):
                log.append(("event waited", id(self)))

        real_copy = torch.Tensor.copy_

        def copy_(self, src, non_blocking=False):
            log.append(
                ("copy", self.untyped_storage().data_ptr(), current[-1] if current else None)
            )
            return real_copy(self, src, non_blocking)

        with cudarecv.ShardedReceiver(group=pg, group_src=[0], timeout=TIMEOUT) as receiver:
            receiver._device = torch.device("cuda", 0)  # its CUDA path, on CPU tensors
            # the rank's pulls land in storage of their own (as after a failed relay forward): every piece is
            # copied into the buffers by the sharded pull
            inner = receiver._inner[0][2]
            for index in (0, 1):
                inner._slots.renew(
                    index, inner.schema, inner._puller.bucket_bytes, torch.device("cpu")
                )
            buffers = {
                v.untyped_storage().data_ptr() for views in receiver._buffers.views for v in views
            }
            lane = receiver._inner[0][2]._lane.stream
            saved = (torch.cuda.synchronize, torch.cuda.stream, torch.cuda.Event)
            torch.cuda.synchronize = lambda device=None: log.append(("synchronize", device))
            torch.cuda.stream, torch.cuda.Event, torch.Tensor.copy_ = stream, Event, copy_
            try:
                got = []
                for version in (1, 2):
                    got.append(receiver.pull() == version)
                    got.append(bool((receiver.td["w"] == version).all()))
                    log.append(("published", version))
            finally:
                torch.cuda.synchronize, torch.cuda.stream, torch.cuda.Event = saved
                del torch.Tensor.copy_  # (torch's own again: TensorBase's)
            transport = receiver.transport
        tail = [
            ("copy", "lane" if entry[2] is lane else repr(entry[2]))
            if entry[0] == "copy"
            else ("record", "lane" if entry[2] is lane else repr(entry[2]), entry[1])
            if entry[0] == "record"
            else entry
            for entry in log
            if entry[0] != "copy" or entry[1] in buffers
        ]
        return got, transport, tail


def test_a_sharded_pull_into_gpu_buffers_never_synchronizes_the_device(cluster):
    """The copies of what did not land in place (here every piece: the rank's receiver lands them in storage of
    its own) run on the lanes' stream, and the version is published once an event recorded on
    it after them fired: no ``torch.cuda.synchronize``, no copy on the default stream."""
    _, (got, transport, tail) = cluster().run(
        _sharded_pull, args=(unique_key("sharded-sync"),), timeout=4 * TIMEOUT
    )
    assert got == [True] * 4, (got, tail)
    assert transport == "wire", transport
    assert not [entry for entry in tail if entry[0] == "synchronize"], tail
    copies = [entry for entry in tail if entry[0] == "copy"]
    assert copies and all(stream == "lane" for _, stream in copies), tail
    start = 0
    for version in (
        1,
        2,
    ):  # each version: its copies, then an event recorded on the lane, waited, published
        end = tail.index(("published", version))
        pull = tail[start:end]
        last_copy = max(i for i, entry in enumerate(pull) if entry[0] == "copy")
        recorded = [e for e in pull[last_copy:] if e[0] == "record" and e[1] == "lane"]
        assert recorded and ("event waited", recorded[-1][2]) in pull[last_copy:], pull
        start = end
