"""NCCL's streams, modelled for the strict NCCL stand-in (:mod:`cudarecv.testing.strict_nccl`; issue 47).

``stand_in_cuda(streams=True)`` with ``StrictNccl(..., streams=True)`` (or ``eager=True``) models what
ProcessGroupNCCL does with streams (``pointToPoint`` in ProcessGroupNCCL.cpp): an op's NCCL stream first
waits for the stream current when it is posted (``syncStream``), and ``Work.wait()`` makes the current stream
wait for the op. Ops of one communicator run on its one stream, in posting order: lazily, a single op on
the pair's communicator (one stream per peer), a batch on the group's; initialised eagerly (``eager=True``,
``device_id=`` in torch), every op on the group's one communicator ("In eagerInit mode, reuse the parent
comm"). So here:

- streams and events record which ops their work waits for (``wait_stream``, ``wait_event``,
  ``record_event``; ``torch.cuda.stream(s)`` makes ``s`` current on this thread);
- each op is run by its communicator stream's executor (a thread), in posting order, once the ops its
  posting stream waited for are done; a send only once its peer's stream reached the matching receive
  (a large message: NCCL keeps it until then), so ranks whose streams wait on each other hang, and the
  executor, within the group's timeout, fails the op naming the rule and where every rank's streams wait;
- with ``memory="host"``: what is allocated with ``device=`` is device memory, which the wire touches in place
  (control bytes, staging rings), every other tensor host memory, staged through device buffers and copy
  streams (:meth:`StreamsModel.host_memory`);
- ``Work.wait()``: the current stream waits for the ops, then the host (the stand-in's copies run on the
  host at once: its data must be there);
- (lazily) posting an op whose stream waits for a pending op with another peer fails (:class:`NcclRuleError`,
  also kept in ``StrictNccl.violations``), unless the op is a send and that op a receive (a relay forwards
  what it received): an edge the protocol does not need, by which a stalled peer stalls the others and
  rings of such waits deadlock.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from .strict_nccl import DESCRIPTOR, SEQ_BITS, Event, NcclRuleError, Op, Stream, StrictNccl

__all__ = ["MODEL", "Streams", "StreamsModel", "ordered_wait"]


def ordered_wait(ops: list[Op]) -> None:
    """``Work.wait()`` with NCCL's streams: the current stream waits for ``ops``; the host goes on."""
    model = MODEL[0]
    if model is None:  # (no streams modelled: the host waits)
        for op in ops:
            _finished(op)
        return
    model.current().add(ops)


def _limit(op: Op | _Copy) -> float:
    """How long ``op`` (an op or a stream's copy) may take at most."""
    return op.timeout if isinstance(op, _Copy) else op.group.timeout


def _finished(op: Op | _Copy) -> None:
    """The host waits for ``op``'s run (bounded: its executor fails it within the group's timeouts)."""
    if not op.finished.wait(4 * _limit(op) + 5.0):
        raise NcclRuleError(f"{op.what()} never ran (the stand-in's executor is stuck)")
    if op.error is not None:
        raise NcclRuleError(str(op.error)) from op.error


class _Executor:
    """A communicator's stream: runs what is posted on it, one unit (an op, or a batch) at a time, in order."""

    def __init__(self, streams: Streams, key: str) -> None:
        self.streams, self.key = streams, key
        self.queue: queue.SimpleQueue[list[Op]] = queue.SimpleQueue()
        group = streams.group
        self.thread = threading.Thread(
            target=self._loop, name=f"strict-nccl-{group.rank()}-{key}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            unit = self.queue.get()
            try:
                self._run(unit)
            except BaseException as error:  # noqa: BLE001 - the op's, raised where it is waited for
                for op in unit:
                    if op.error is None and not op.finished.is_set():
                        op.error = error
            finally:
                for op in unit:
                    op.done = True
                    op.finished.set()
                self.streams.at(self.key, None)

    def _run(self, unit: list[Op]) -> None:
        group = self.streams.group
        for op in unit:
            for dep in op.deps:
                self.streams.at(self.key, f"{op.what()}, after {dep.what()}")
                if not dep.finished.wait(group.timeout):
                    raise NcclRuleError(
                        f"{op.what()} never started: the stream it was posted under waits for "
                        f"{dep.what()}, not done within {group.timeout:g} s (an op starts only after "
                        "what its stream was ordered after; NCCL would hang here). "
                        + self.streams.where()
                    )
                if dep.error is not None:
                    raise NcclRuleError(f"{op.what()} never started: {dep.what()} failed")
        self.streams.at(self.key, " + ".join(op.what() for op in unit))
        for op in unit:
            _begin(op)
        for op in unit:
            _end(op, self.streams)


def _begin(op: Op) -> None:
    """Start ``op`` on its stream: a receive says it is ready (and takes the descriptor), a send listens."""
    group, peer = op.group, op.peer
    ready_tag = op._tag + (2 << (SEQ_BITS + 1))  # (the communicator's bit moves up: its own tags)
    if op.sending:
        op._works = [group.gloo_recv(op._token, peer, ready_tag)]
    else:
        op._descriptor = torch.zeros(DESCRIPTOR.size, dtype=torch.uint8)
        op._works = [
            group.gloo_recv(op._descriptor, peer, op._tag),
            group.gloo_send(op._token, peer, ready_tag),
        ]


def _end(op: Op, streams: Streams) -> None:
    """Finish ``op``: a send once its peer's receive is ready (then its descriptor and payload), a receive
    as :meth:`Op.finish` does."""
    group, peer = op.group, op.peer
    if op.sending:
        try:
            op._wait(
                op._works[0],
                "its peer's stream never reached the matching receive (a large message waits for it)",
            )
        except NcclRuleError as error:
            raise NcclRuleError(f"{error}. {streams.where()}") from error
        descriptor = torch.frombuffer(
            bytearray(DESCRIPTOR.pack(op._flat.numel(), op.tensor.element_size())),
            dtype=torch.uint8,
        )
        for work, why in (
            (group.gloo_send(descriptor, peer, op._tag), "its peer never took the descriptor"),
            (group.gloo_send(op._flat, peer, op._tag + 1), "its peer never took the payload"),
        ):
            op._wait(work, why)
        return
    ready = op._works.pop()
    try:
        op.finish()
    except NcclRuleError as error:
        raise NcclRuleError(f"{error}. {streams.where()}") from error
    op._wait(ready, "its peer never took the ready token")


class Streams:
    """A group's communicator streams (see above): an executor per stream, the rule on unneeded waits, and
    where this rank's streams wait (in the group's store, for the errors of every rank)."""

    def __init__(self, group: StrictNccl) -> None:
        self.group = group
        self._executors: dict[str, _Executor] = {}
        self._lock = threading.Lock()
        # (on a connection of its own: a TCPStore client runs one call at a time, so a test's bounded
        # ``store().wait()`` on the shared one, a stalled receiver's, held the executors' reports here, and
        # with them the ops they run, until it returned)
        self._meta = dist.PrefixStore(f"{group._name}/streams", _own_connection(group._store))

    def keys(self) -> list[str]:
        return ["group"] + [f"pair:{p}" for p in range(self.group.size())]

    def at(self, key: str, what: str | None) -> None:
        """Say (in the store) what this rank's stream ``key`` waits for now (None: nothing)."""
        with contextlib.suppress(Exception):
            self._meta.set(f"{self.group.rank()}/{key}", what or "")

    def where(self) -> str:
        """Where every rank's streams wait, as they said (a wait cycle shows there)."""
        said = []
        for rank in range(self.group.size()):
            for key in self.keys():
                name = f"{rank}/{key}"
                with contextlib.suppress(Exception):
                    if self._meta.check([name]):
                        what = self._meta.get(name).decode()
                        if what:
                            said.append(f"rank {rank}'s {key} stream: {what}")
        return "Where each rank's streams wait: " + ("; ".join(said) or "nowhere said")

    def posting(self, op: Op) -> None:
        """``op`` is posted under the current stream: it starts after that stream's pending ops; lazily, one of
        them with another peer is an unneeded wait unless ``op`` sends what it received."""
        model = MODEL[0]
        op.deps = model.current().pending() if model is not None else []
        if (
            self.group.eager
        ):  # (every op waits for the one before on the group's stream: torch's, not cudarecv's)
            if model is not None:
                model.posted.add([op])
            return
        other = _other_peer(op)
        if other is not None:
            problem = (
                f"{op.what()} is posted under a stream that waits for {other.what()}, still pending: "
                "an op with one peer must not wait for a pending op with another (unless it sends what that "
                "one received): on NCCL a stalled peer would stall this one, and ranks whose such waits "
                "form a ring deadlock"
            )
            self.group.violations.append(problem)
            raise NcclRuleError(problem)
        if model is not None:
            model.posted.add([op])

    def post(self, key: str, unit: list[Op]) -> None:
        if not unit:
            return
        with self._lock:
            executor = self._executors.get(key)
            if executor is None:
                executor = self._executors[key] = _Executor(self, key)
        executor.queue.put(unit)


def _own_connection(store: dist.Store) -> dist.Store:
    """``store`` on a connection of its own where it can have one (a TCPStore's clone), else ``store``."""
    clone = getattr(store, "clone", None)  # (torch's type stubs do not declare it)
    try:
        return store if clone is None else cast(dist.Store, clone())
    except (RuntimeError, NotImplementedError):
        return store


def _other_peer(op: Op) -> Op | _Copy | None:
    """A pending op with another peer that ``op`` would wait for, through its stream, and need not."""
    seen: set[int] = set()
    stack = list(op.deps)
    while stack:
        dep = stack.pop()
        if id(dep) in seen or dep.finished.is_set():
            continue
        seen.add(id(dep))
        if isinstance(dep, _Copy) or dep.peer_global == op.peer_global:
            stack.extend(
                dep.deps
            )  # (its own waits were checked when it was posted; a copy passes them on)
        elif not (op.sending and not dep.sending):
            return dep
    return None


class _TrackedStream(Stream):
    """A stand-in stream that knows which ops its work waits for (the pending ones)."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self._lock = threading.Lock()
        self._ops: list[Any] = []

    def pending(self) -> list[Any]:
        with self._lock:
            self._ops = [op for op in self._ops if not op.finished.is_set()]
            return list(self._ops)

    def add(self, ops: list[Any]) -> None:
        with self._lock:
            known = {id(op) for op in self._ops}
            self._ops = [op for op in self._ops if not op.finished.is_set()] + [
                op for op in ops if id(op) not in known and not op.finished.is_set()
            ]

    def wait_stream(self, other: Any) -> None:
        if other is not self and isinstance(other, _TrackedStream):
            self.add(other.pending())

    def wait_event(self, event: Any) -> None:
        if isinstance(event, _TrackedEvent):
            self.add(event._ops)

    def record_event(self, event: Any = None) -> Event:
        event = event if isinstance(event, _TrackedEvent) else _TrackedEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        for op in self.pending():
            _finished(op)

    def query(self) -> bool:
        return not self.pending()


class _TrackedEvent(Event):
    """A stand-in event: the ops pending on its stream when it was recorded."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._ops: list[Any] = []

    def record(self, stream: Any = None) -> None:
        model = MODEL[0]
        stream = stream if stream is not None else (model.current() if model else None)
        self._ops = stream.pending() if isinstance(stream, _TrackedStream) else []

    def query(self) -> bool:
        return all(op.finished.is_set() for op in self._ops)

    def synchronize(self) -> None:
        for op in self._ops:
            _finished(op)

    def wait(self, stream: Any = None) -> None:
        model = MODEL[0]
        target = stream if stream is not None else (model.current() if model else None)
        if isinstance(target, _TrackedStream):
            target.add(self._ops)


class _Copy:
    """A copy queued on a stream that waits for pending ops: it runs (on a thread of its own) once they are
    done, as the GPU would run it, while the host goes on; what comes after it on its stream waits for it."""

    peer_global = None
    sending = False

    def __init__(self, run: Any, args: Any, kwargs: Any, deps: list[Any]) -> None:
        self.deps = deps
        self.timeout = max(_limit(dep) for dep in deps)
        self.error: BaseException | None = None
        self.done = False
        self.finished = threading.Event()
        threading.Thread(target=self._run, args=(run, args, kwargs), daemon=True).start()

    def what(self) -> str:
        return "a copy on a stream"

    def _run(self, run: Any, args: Any, kwargs: Any) -> None:
        try:
            for dep in self.deps:
                if not dep.finished.wait(4 * _limit(dep) + 5.0) or dep.error is not None:
                    self.error = NcclRuleError(f"a stream's copy never ran: {dep.what()} failed")
                    return
            run(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - raised where the stream is waited for
            self.error = error
        finally:
            self.done = True
            self.finished.set()


class LazyPair:
    """A pair group made at once and formed with its peer on a thread of its own (as NCCL forms a lazily
    initialised pair's communicator at its first op, where gloo's constructor waits for the peer's): its ops
    wait until it has formed (bounded)."""

    def __init__(self, make: Any, rank: int, timeout: float, before_abort: Any = None) -> None:
        self._rank, self._timeout, self._before_abort = rank, timeout, before_abort
        #: abort() / shutdown() were called (whether or not it had formed)
        self.aborted = self.shut = False
        self._group: StrictNccl | None = None
        self._error: BaseException | None = None
        self._formed = threading.Event()
        threading.Thread(target=self._form, args=(make,), daemon=True).start()

    def _form(self, make: Any) -> None:
        try:
            self._group = make()
        except BaseException as error:  # noqa: BLE001 - raised by the first op
            self._error = error
        finally:
            self._formed.set()

    def group(self) -> StrictNccl:
        if not self._formed.wait(2 * self._timeout):
            raise NcclRuleError("a pair group never formed: its peer never made its end")
        if self._group is None:
            raise NcclRuleError(f"a pair group could not form: {self._error}") from self._error
        return self._group

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self.group().send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self.group().recv(tensors, src, tag)

    def abort(self) -> None:
        if self._before_abort is not None:
            self._before_abort()
        self.aborted = True
        if self._formed.wait(2 * self._timeout) and self._group is not None:
            self._group.abort()

    def shutdown(self) -> None:
        self.shut = True
        if self._formed.is_set() and self._group is not None:
            self._group.shutdown()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def name(self) -> str:
        return "NCCL"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "nccl"


class StreamsModel:
    """This process's current stream per thread (the default stream unless ``torch.cuda.stream(s)``) and the
    ops it posted (``torch.cuda.synchronize()`` waits for them all)."""

    def __init__(self) -> None:
        self.default = _TrackedStream()
        self._local = threading.local()
        self.posted = _TrackedStream()  # (every op posted in this process, while pending)

    def current(self) -> _TrackedStream:
        return getattr(self._local, "stream", None) or self.default

    @contextlib.contextmanager
    def using(self, stream: Any = None) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        if isinstance(stream, _TrackedStream):
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def patches(self) -> dict[tuple[Any, str], Any]:
        def synchronize(device: Any = None) -> None:
            self.posted.synchronize()

        copy, foreach_copy = torch.Tensor.copy_, torch._foreach_copy_

        def ordered(run: Any) -> Any:
            """A stream's copy: at once, or (its stream waits for pending work) once that work is done."""

            def copied(*args: Any, **kwargs: Any) -> Any:
                stream = self.current()
                deps = stream.pending()
                if not deps:
                    return run(*args, **kwargs)
                task = _Copy(run, args, kwargs, deps)
                stream.add([task])
                self.posted.add([task])
                return args[0] if run is copy else None

            return copied

        return {
            (torch.Tensor, "copy_"): ordered(copy),
            (torch, "_foreach_copy_"): ordered(foreach_copy),
            (torch.cuda, "Stream"): _TrackedStream,
            (torch.cuda, "Event"): _TrackedEvent,
            (torch.cuda, "current_stream"): lambda device=None: self.current(),
            (torch.cuda, "default_stream"): lambda device=None: self.default,
            (torch.cuda, "stream"): self.using,
            (torch.cuda, "synchronize"): synchronize,
        }

    def host_memory(self, empty: Any, zeros: Any) -> dict[tuple[Any, str], Any]:
        """What ``stand_in_cuda(memory="host", streams=True)`` patches over ``empty``/``zeros`` (its own): what is
        allocated with an explicit ``device=`` is stand-in device memory, which the wire touches in place (as
        NCCL does a CUDA tensor: control bytes, staging rings); every other tensor is host memory, staged
        through device buffers. (Counted as host memory, the control bytes went through staging, which a GPU
        never does, and the handshake's steps split where they do not on a GPU.)"""
        from cudarecv.wire import staging

        on_device: set[int] = set()

        def allocating(make: Any) -> Any:
            def allocate(*args: Any, **kwargs: Any) -> torch.Tensor:
                tensor = make(*args, **kwargs)
                if kwargs.get("device") is not None:
                    on_device.add(id(tensor))
                    weakref.finalize(tensor, on_device.discard, id(tensor))
                return tensor

            return allocate

        def wire_can_touch(lane: Any, tensors: Any) -> bool:
            if not tensors:
                return True
            base = tensors[0]._base if tensors[0]._base is not None else tensors[0]
            return (id(base) in on_device) == lane.nccl

        return {
            (torch, "empty"): allocating(empty),
            (torch, "zeros"): allocating(zeros),
            (staging, "wire_can_touch"): wire_can_touch,
        }


#: the model of the process inside ``stand_in_cuda(streams=True)`` (one element: set and read by reference)
MODEL: list[StreamsModel | None] = [None]
