"""A strict stand-in for NCCL on the CPU: NCCL's matching rules, checked, with gloo carrying the bytes.

cudarecv's NCCL protocol paths cannot run without two GPUs, yet their bugs are about *matching*, which
needs no GPU: NCCL ignores tags and matches point-to-point messages in posting order per communicator;
torch runs a single p2p op on a two-rank communicator of the pair and a batched (coalesced) one on the
group's communicator (without ``device_id``), so two ends that batch differently never meet; the group's
communicator is created by every rank of the group together, at its first batched op; and the coalescing
state of a group is one per group, not per thread. :class:`StrictNccl` behaves so, and instead of hanging
it raises :class:`NcclRuleError` naming the rule, within its timeout:

- every op is matched by (communicator, direction, peer, posting index), never by tag;
- a receive whose peer sent another number of bytes (NCCL: garbage or a hang) fails, the bytes drained;
- a rank's first batched op waits for every rank of the group to reach theirs, or fails naming the absent
  (before anything is posted, as NCCL makes the communicator inside it);
- an op or a ``_start_coalescing`` from a second thread while one thread coalesces fails;
- ``_start_coalescing()`` and ``_end_coalescing()`` take no argument, as a standalone NCCL backend's;
- every wait ends within the group's timeout;
- with ``streams=True`` (and ``stand_in_cuda(streams=True)``), NCCL's streams: each op runs on its
  communicator's stream after what its posting stream waits for, a send once its peer's receive is reached,
  and an op that waits for a pending op with another peer (unneeded) is refused; ``eager=True`` puts every op
  on the group's one communicator, as ``device_id=`` does (:mod:`cudarecv.testing.strict_streams`);
- with ``sends_done_at_posting=True``, a send completes as NCCL's does (its ``Work`` is done once it is
  enqueued on the pair's stream; its bytes leave only when the peer posts the matching receive, or never),
  and :meth:`StrictNccl.abort` ends the group as ``ProcessGroupNCCL.abort()`` does (an op posted after it
  fails).

:func:`stand_in_cuda` makes the CPU stand in for CUDA in this process (streams and events that are
done at once), so the NCCL paths run on CPU tensors: with ``memory="device"`` the tensors count as device
memory (the wire touches them), with ``memory="host"`` as host memory (staged through "device" buffers).
It patches ``torch.cuda``, pinned allocations (plain host memory stands in) and one cudarecv internal (:func:`cudarecv.wire.staging.wire_can_touch`) in this
process only; use it in spawned ranks, never in a process that uses a real GPU.

Example (in each rank)::

    with stand_in_cuda(memory="device"):
        group = StrictNccl(store, rank, world, timeout=20.0)
        cudarecv.send(td, group=group, group_dst=1, bucket_bytes=1 << 16)
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cudarecv import Error

__all__ = ["NcclRuleError", "StrictNccl", "stand_in_cuda"]

DESCRIPTOR = struct.Struct(
    "<QQ"
)  # bytes (what NCCL's count x type size must agree on), element size
_COMMS = {"group": 0, "pair": 1}
SEQ_BITS = 28  # posting indices per (communicator, direction, peer): tags stay below 2**31


class NcclRuleError(Error, RuntimeError):
    """An op broke a rule of NCCL's: on a GPU it would hang, deadlock or move garbage."""


class Work:
    """The ops of one call: waited for within the group's timeout (a timeout says which rule it broke)."""

    def __init__(self, group: StrictNccl, ops: list[Op]) -> None:
        self._group, self._ops = group, ops

    def is_completed(self) -> bool:
        return all(op.done for op in self._ops)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._group.streams:  # the current stream waits for the ops (then, here, the host too)
            from .strict_streams import ordered_wait

            ordered_wait(self._ops)
            return True
        for op in self._ops:
            op.finish()
        return True

    def result(self) -> list[torch.Tensor]:
        return []


class Op:
    """One NCCL send or receive, as two gloo messages: its descriptor (size) and its payload."""

    def __init__(
        self,
        group: StrictNccl,
        sending: bool,
        tensor: torch.Tensor,
        peer: int,
        comm: str,
        index: int,
    ) -> None:
        self.group, self.sending, self.tensor, self.peer, self.comm, self.index = (
            group,
            sending,
            tensor,
            peer,
            comm,
            index,
        )
        #: whether its Work is complete (NCCL's, with ``sends_done_at_posting``: a send is, once posted)
        self.done = sending and group.sends_done_at_posting
        self._tag = (_COMMS[comm] << (SEQ_BITS + 1)) | (index << 1)
        flat = (
            tensor.detach().reshape(-1).view(torch.uint8)
            if tensor.numel()
            else torch.zeros(0, dtype=torch.uint8)
        )
        self._flat = flat
        #: with ``streams=True``: the pending ops of the stream it was posted under (it starts after them), its
        #: peer's global rank, and once it ran, whether it failed (its stream's executor runs it)
        self.deps: list[Op] = []
        self.peer_global = group.ranks[peer]
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._token = torch.zeros(1, dtype=torch.uint8)  # (a receive's "ready", with ``streams``)
        if group.streams:
            return  # (posted by its stream's executor, once what it waits for is done: _Streams)
        if sending:
            descriptor = torch.frombuffer(
                bytearray(DESCRIPTOR.pack(flat.numel(), tensor.element_size())), dtype=torch.uint8
            )
            self._works = [
                group.gloo_send(descriptor, peer, self._tag),
                group.gloo_send(flat, peer, self._tag + 1),
            ]
            if (
                self.done
            ):  # (kept until the group goes: the peer may take the bytes any time, or never)
                group.posted.extend(self._works)
        else:
            self._descriptor = torch.zeros(DESCRIPTOR.size, dtype=torch.uint8)
            self._works = [group.gloo_recv(self._descriptor, peer, self._tag)]

    def what(self) -> str:
        verb = "send to" if self.sending else "receive from"
        ranks = self.group.ranks  # (a pair group's ends: named by their ranks in the larger group)
        return f"rank {ranks[self.group.rank()]}'s {self.comm}-communicator {verb} rank {ranks[self.peer]} (op #{self.index})"

    def finish(self) -> None:
        if self.done:
            return
        self._wait(self._works[0], "its peer posted no matching op on that communicator")
        if not self.sending:
            nbytes, _ = DESCRIPTOR.unpack(self._descriptor.numpy().tobytes())
            if (
                nbytes != self._flat.numel()
            ):  # (NCCL moves count x type size bytes: those must agree)
                scratch = torch.empty(nbytes, dtype=torch.uint8)
                self._wait(self.group.gloo_recv(scratch, self.peer, self._tag + 1), "draining")
                raise NcclRuleError(
                    f"{self.what()} expects {self._flat.numel()} bytes; the peer's matching op sent "
                    f"{nbytes}: NCCL matches by order, not tag, and would move garbage or hang"
                )
            self._wait(
                self.group.gloo_recv(self._flat, self.peer, self._tag + 1), "the payload never came"
            )
        else:
            self._wait(self._works[1], "its peer never took the payload")
        self.done = True

    def _wait(self, work: Any, why: str) -> None:
        try:
            work.wait(timedelta(seconds=self.group.timeout))
        except Exception as error:  # noqa: BLE001 - gloo's timeout or a closed link: the rule it broke
            raise NcclRuleError(
                f"{self.what()} did not complete within {self.group.timeout:g} s: {why} "
                "(NCCL would hang here)"
            ) from error


class StrictNccl(dist.ProcessGroupGloo):
    """A standalone "NCCL" group of ``size`` ranks that checks NCCL's rules (see the module docstring).

    Built on ``store`` (every rank the same); its bytes travel over a gloo group of its own. ``ops`` records
    each op as ``(communicator, "send" | "recv", peer, bytes)`` for tests.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: float = 20.0,
        name: str = "strict",
        sends_done_at_posting: bool = False,
        streams: bool = False,
        eager: bool = False,
        ranks: list[int] | None = None,
        registered: bool = False,
    ) -> None:
        super().__init__(
            dist.PrefixStore(f"{name}/data", store), rank, size, timedelta(seconds=timeout)
        )
        #: NCCL's streams modelled (see :mod:`cudarecv.testing.strict_streams`; needs ``stand_in_cuda(streams=True)``); ``eager``:
        #: initialised as with ``device_id=`` (every op on the group's one communicator, one stream)
        self.streams = streams or eager
        self.eager = eager
        #: what torch.distributed says of an eagerly initialised group (cudarecv reads it)
        self.bound_device_id = torch.device("cuda", 0) if eager else None
        #: each rank's rank in the world (a pair group of two ranks of a larger one: theirs there)
        self.ranks = list(range(size)) if ranks is None else list(ranks)
        self._store, self._name = store, name
        #: the unneeded waits found with ``streams`` (each also raised where its op was posted)
        self.violations: list[str] = []
        from .strict_streams import Streams

        self._streams_of = Streams(self) if self.streams else None
        self.timeout = timeout
        self._meta = dist.PrefixStore(f"{name}/meta", store)
        self._lock = threading.Lock()
        self._next: dict[tuple[str, bool, int], int] = {}
        self._coalescing: threading.Thread | None = None
        self._batch: list[Op] = []
        self._group_ready = False
        self.ops: list[tuple[str, str, int, int]] = []
        #: a send's Work is done once posted, as NCCL's (its wait orders the stream, the host never waits)
        self.sends_done_at_posting = sends_done_at_posting
        #: the gloo works of the sends posted that way, whether or not their peer ever took them
        self.posted: list[Any] = []
        #: :meth:`abort` was called (``ProcessGroupNCCL.abort()``: every communicator of the group ended)
        self.aborted = False
        #: :meth:`shutdown` was called (a pair group cudarecv let go of)
        self.shut = False
        #: stands in for a group torch.distributed knows: cudarecv forms pair groups on its store
        #: (:func:`cudarecv.wire.staging.pair_link`); a standalone one has none
        self.registered = registered
        #: the pair groups made on this one (:meth:`pair`), in order
        self.pairs: list[Any] = []
        #: tests: run by a pair group's :meth:`abort` before it aborts (a slow abort, or one that fails)
        self.on_abort: Any = None

    def abort(self) -> None:
        """End the group, as ``ProcessGroupNCCL.abort()`` ends its communicators: an op posted after it fails
        (what was posted before is never taken; gloo keeps it until the group goes)."""
        self.aborted = True

    def shutdown(self) -> None:
        """Let go of the group, as ``ProcessGroupNCCL.shutdown()`` (an op posted after it fails)."""
        self.shut = True

    def pair_store(self) -> dist.Store | None:
        """The store cudarecv forms pair groups on: this group's, if it stands in for a registered one."""
        return (
            dist.PrefixStore(f"{self._name}/registered", self._store) if self.registered else None
        )

    def pair(self, peer: int, prefix: str, store: dist.Store) -> Any:
        """A lazily initialised group of this rank and ``peer`` on ``store`` under ``prefix`` (what cudarecv
        forms on a registered group: :func:`cudarecv.wire.staging.pair_link`). As NCCL's, it is made at once and
        formed with the peer at its first op (gloo's rendezvous runs on a thread:
        :class:`cudarecv.testing.strict_streams.LazyPair`). Its ``abort()`` runs :attr:`on_abort` first."""
        from .strict_streams import LazyPair

        low, high = sorted((self.rank(), peer))
        me = 0 if self.rank() == low else 1
        pair = LazyPair(
            lambda: StrictNccl(
                store,
                me,
                2,
                self.timeout,
                name=prefix,
                streams=self.streams,
                sends_done_at_posting=self.sends_done_at_posting,
                ranks=[self.ranks[low], self.ranks[high]],
            ),
            me,
            self.timeout,
            before_abort=lambda: self.on_abort() if self.on_abort is not None else None,
        )
        self.pairs.append(pair)
        return pair

    # -- what torch's ProcessGroupNCCL says of itself ----------------------------------------------------
    def name(self) -> str:
        return "NCCL"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "nccl"

    # -- the underlying gloo (not NCCL's API) --------------------------------------------------------------
    def gloo_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return super().send([tensor], peer, tag)  # type: ignore[misc]  # (gloo's: torch's stubs omit it)

    def gloo_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return super().recv([tensor], peer, tag)  # type: ignore[misc]  # (gloo's: torch's stubs omit it)

    # -- NCCL's point-to-point API, as torch exposes it on a backend ---------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._op(True, tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._op(False, tensors, src)

    def _start_coalescing(self) -> None:  # (a backend's takes no device, unlike ProcessGroup's)
        me = threading.current_thread()
        if (
            not self._group_ready and not self.eager
        ):  # NCCL makes the communicator inside the first op, before anything is posted
            self._first_batch()
        with self._lock:
            if self._coalescing is not None:
                raise NcclRuleError(
                    f"{me.name} starts coalescing while {self._coalescing.name} coalesces on the "
                    "same group: the coalescing state is one per group, and the two batches mix"
                )
            self._coalescing, self._batch = me, []

    def _end_coalescing(self) -> Work:
        with self._lock:
            if self._coalescing is not threading.current_thread():
                raise NcclRuleError("_end_coalescing on a thread that did not start it")
            batch, self._coalescing, self._batch = self._batch, None, []
        if self._streams_of is not None:
            self._streams_of.post("group", batch)
        return Work(self, batch)

    def _op(self, sending: bool, tensors: list[torch.Tensor], peer: int) -> Any:
        if len(tensors) != 1:
            raise NcclRuleError(f"one tensor per point-to-point op, got {len(tensors)}")
        me = threading.current_thread()
        if self.aborted or self.shut:
            raise NcclRuleError(
                f"rank {self.rank()} posts an op on a group whose communicators were "
                f"{'aborted' if self.aborted else 'shut down'}"
            )
        with self._lock:
            if self._coalescing is not None and self._coalescing is not me:
                raise NcclRuleError(
                    f"{me.name} posts an op while {self._coalescing.name} coalesces on the same "
                    "group: torch puts it in the other thread's batch"
                )
            comm = "group" if self._coalescing is me or self.eager else "pair"
            key = (comm, sending, peer)
            index = self._next.get(key, 0)
            self._next[key] = index + 1
            if index >= 1 << SEQ_BITS:
                raise NcclRuleError("more ops on one communicator than this stand-in counts")
            op = Op(self, sending, tensors[0], peer, comm, index)
            self.ops.append(
                (
                    comm,
                    "send" if sending else "recv",
                    peer,
                    tensors[0].numel() * tensors[0].element_size(),
                )
            )
            if self._streams_of is not None:
                self._streams_of.posting(op)
            if self._coalescing is me:
                self._batch.append(op)
            elif self._streams_of is not None:
                self._streams_of.post(comm if comm == "group" else f"pair:{peer}", [op])
        return Work(self, [op]) if self._coalescing is not me else Work(self, [])

    def _first_batch(self) -> None:
        """The group's communicator is made by every rank together: wait for all of theirs (bounded)."""
        self._meta.set(f"group-init/{self.rank()}", "1")
        keys = [f"group-init/{r}" for r in range(self.size())]
        try:
            self._meta.wait(keys, timedelta(seconds=self.timeout))
        except Exception as error:  # noqa: BLE001 - the store's timeout: some rank never batched
            absent = [r for r, key in enumerate(keys) if not self._meta.check([key])]
            raise NcclRuleError(
                f"rank {self.rank()}'s first batched op on this group of {self.size()}: NCCL creates the group's "
                f"communicator with every rank of the group at once, and rank(s) {absent} made no batched op "
                f"within {self.timeout:g} s (NCCL would hang here)"
            ) from error
        self._group_ready = True


class Stream:
    """A CUDA stream stood in by the CPU: whatever it was asked to do is done."""

    device = torch.device("cpu")

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        return event or Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Event:
    """A CUDA event stood in by the CPU: it has fired."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


@contextlib.contextmanager
def stand_in_cuda(
    memory: str = "device", pageable: bool = False, streams: bool = False
) -> Iterator[None]:
    """Let the CPU stand in for CUDA in this process (see the module docstring); ``memory``: whether
    CPU tensors count as device memory (``"device"``) or as host memory (``"host"``) on an NCCL link;
    ``pageable`` (host memory only): copies to and from pageable host memory wait for the stream, as
    CUDA's do (:mod:`cudarecv.testing.strict_pageable`); ``streams``: streams and events record which ops they wait
    for, for groups made with ``StrictNccl(..., streams=True)`` (:mod:`cudarecv.testing.strict_streams`)."""
    if memory not in ("device", "host"):
        raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
    if pageable and memory != "host":
        raise ValueError(f"pageable=True models host memory: pass memory='host', got {memory!r}")
    if pageable and streams:
        raise ValueError("pageable=True and streams=True model the stream apart: pass one of them")
    from cudarecv.core import streams as cuda_streams
    from cudarecv.wire import staging

    stream = Stream()
    empty, zeros = torch.empty, torch.zeros

    def unpinned(make):  # (page-locked memory needs an accelerator: plain host memory stands in)
        return lambda *args, pin_memory=False, **kwargs: make(*args, **kwargs)

    patches = {
        (torch, "empty"): unpinned(empty),
        (torch, "zeros"): unpinned(zeros),
        (torch.Tensor, "pin_memory"): lambda self, *args, **kwargs: self,
        (torch.Tensor, "is_pinned"): lambda self, *args, **kwargs: self.device.type == "cpu",
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "Stream"): Stream,
        (torch.cuda, "Event"): Event,
        (torch.cuda, "current_stream"): lambda device=None: stream,
        (torch.cuda, "stream"): lambda s=None: contextlib.nullcontext(),
        (torch.cuda, "device"): lambda d=None: contextlib.nullcontext(),
        (torch.cuda, "synchronize"): lambda device=None: None,
        # cudarecv's streams from the (patched) torch.cuda.Stream, not cupy's: no real stream in the stand-in
        (cuda_streams, "_CUPY"): None,
    }
    if memory == "device":
        real = staging.wire_can_touch
        patches[(staging, "wire_can_touch")] = lambda lane, tensors: (
            lane.nccl or real(lane, tensors)
        )
    pageable_model = None
    if pageable:
        from .strict_pageable import PageableModel

        pageable_model = PageableModel()
        patches.update(pageable_model.patches())
    from .strict_streams import MODEL, StreamsModel

    model = StreamsModel() if streams else None
    if model is not None:
        patches.update(model.patches())
        if memory == "host":  # (allocated with device=: stand-in device memory)
            patches.update(model.host_memory(patches[(torch, "empty")], patches[(torch, "zeros")]))
    # a pair group on a registered one (cudarecv.wire.staging.pair_link): the stand-in's own
    if hasattr(staging, "pair_store"):
        patches[(staging, "make_pair")] = lambda link, prefix, store: link.pg.pair(
            link.peer, prefix, store
        )
        patches[(staging, "pair_store")] = lambda link: (
            link.pg.pair_store() if isinstance(link.pg, StrictNccl) else None
        )
    saved = {key: getattr(*key) for key in patches}
    try:
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        MODEL[0] = model
        yield
    finally:
        MODEL[0] = None
        if pageable_model is not None:
            pageable_model.close()
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
