"""Pageable host memory in the strict NCCL stand-in: ``stand_in_cuda(memory="host", pageable=True)``.

What makes a copy between device memory and *pageable* host memory block (issue 47, defect 3). On a GPU
an NCCL op's ``Work.wait()`` only orders the current stream after the op (the host goes on), and
``cudaMemcpyAsync`` between device memory and pageable host memory is synchronous: device to host it
returns only once the copy has run, host to device it may first wait for the stream (CUDA stages the bytes
through memory of its own). So it waits for the stream's earlier work, e.g. a receive the peer has not
matched yet. With pinned memory the copy is asynchronous. In this mode the stand-in has one stream for the
process, run in order by a thread of its own as a GPU runs its work (a coarse model: everything waits for
all the work queued before it, whichever stream it was queued on):

- ``Work.wait()`` queues the op's completion (a receive takes its payload then) and returns at once; a
  send's bytes go out when the stream reaches the send;
- stand-in device memory is what is allocated with an explicit ``device=`` (the wire touches it in place);
  a copy between device memory and pinned or device
  memory with ``non_blocking=True`` is queued; between device memory and pageable host memory (anything
  else: not made with ``pin_memory=True`` or by ``Tensor.pin_memory()``), or without ``non_blocking``,
  the host waits for the stream, then copies; between host buffers it copies at once;
- an event covers what was queued when it was recorded: ``synchronize()`` waits for the stream to get
  that far, ``query()`` says whether it has; ``Stream.synchronize()`` and ``torch.cuda.synchronize()``
  wait for all of it. An op that fails on the stream (each ends within its group's timeout, else
  :class:`~cudarecv.testing.strict_nccl.NcclRuleError`) is raised by the first wait that covers it.

Use it in spawned ranks only, as :func:`~cudarecv.testing.strict_nccl.stand_in_cuda`.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .strict_nccl import Event as StandInEvent
from .strict_nccl import NcclRuleError, StrictNccl, Work
from .strict_nccl import Stream as StandInStream

__all__ = ["PageableModel"]

Job = Callable[[], object]


class PageableModel:
    """The stand-in stream (its queued work and the thread that runs it) and where each stand-in
    allocation lives (see the module docstring). :meth:`patches` are what ``stand_in_cuda`` patches;
    :meth:`close` ends the stream's thread once what was queued has run (bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards everything below
        self._changed = threading.Condition(self._lock)
        self._queue: deque[tuple[int, Job]] = deque()  # (sequence number, what to do), in order
        self._queued = 0  # the last sequence number given out
        self._ran = 0  # every item up to this one has run
        self._failed: list[tuple[int, BaseException]] = []  # items that raised, not yet reported
        self._closed = False
        #: storage address: its place, and the tensor allocated there (a dead one: the address is free)
        self._places: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self._thread = threading.Thread(target=self._run, name="stand-in-stream", daemon=True)
        self._thread.start()

    # -- where memory lives ----------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor, place: str) -> torch.Tensor:
        """Note ``tensor``'s storage as ``"pinned"`` or ``"device"`` memory; return ``tensor``."""
        with self._lock:
            self._places[tensor.untyped_storage().data_ptr()] = (place, weakref.ref(tensor))
        return tensor

    def place(self, tensor: torch.Tensor) -> str:
        """``"pinned"``, ``"device"`` or ``"pageable"`` (a storage noted once whose tensor is gone: pageable)."""
        with self._lock:
            found = self._places.get(tensor.untyped_storage().data_ptr())
        if found is None or found[1]() is None:
            return "pageable"
        return found[0]

    # -- the stream ------------------------------------------------------------------------------------
    def queue(self, job: Job) -> int:
        """Queue ``job()`` on the stream; its sequence number."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the stand-in stream was closed (stand_in_cuda has exited)")
            self._queued += 1
            self._queue.append((self._queued, job))
            self._changed.notify_all()
            return self._queued

    def point(self) -> int:
        """The sequence number an event recorded now covers."""
        with self._lock:
            return self._queued

    def ran(self, number: int) -> bool:
        with self._lock:
            return self._ran >= number

    def wait(self, number: int | None = None) -> None:
        """Block until the stream has run item ``number`` (all that is queued: None); raise the first
        failure of an item up to it not raised yet."""
        with self._lock:
            number = self._queued if number is None else number
            while self._ran < number:
                self._changed.wait()
            failed = [(n, e) for n, e in self._failed if n <= number]
            self._failed = [(n, e) for n, e in self._failed if n > number]
        if failed:
            error = failed[0][1]
            raise NcclRuleError(f"the stand-in stream's work failed: {error}") from error

    def _run(self) -> None:
        """The stream: run the queued items in order (each op's completion is bounded by its group)."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                number, job = self._queue.popleft()
            try:
                job()
            except BaseException as error:  # noqa: BLE001 - kept for the wait that covers it
                with self._lock:
                    self._failed.append((number, error))
            with self._lock:
                self._ran = number
                self._changed.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Let the stream run what is queued, then end its thread (waiting ``timeout`` s at most)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, real: Job) -> None:
        """A copy as CUDA makes it (see the module docstring): now, queued, or once the stream has run."""
        places = {self.place(dst), self.place(src)}
        if "device" not in places:
            real()
        elif non_blocking and "pageable" not in places:
            self.queue(real)
        else:
            self.wait()
            real()

    # -- the patches -----------------------------------------------------------------------------------
    def patches(self) -> dict[tuple[Any, str], Any]:
        """What ``stand_in_cuda`` patches in this mode (over its own patches)."""
        from cudarecv.wire import staging

        model = self
        real_copy = torch.Tensor.copy_
        real_gloo_send = StrictNccl.gloo_send

        class Event(StandInEvent):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._number = 0

            def record(self, stream: Any = None) -> None:
                self._number = model.point()

            def query(self) -> bool:
                return model.ran(self._number)

            def synchronize(self) -> None:
                model.wait(self._number)

        class Stream(StandInStream):
            def record_event(self, event: Any = None) -> Event:
                event = event or Event()
                event.record(self)
                return event

            def synchronize(self) -> None:
                model.wait()

            def query(self) -> bool:
                return model.ran(model.point())

        class Sent:
            """A send's gloo work, posted when the stream reaches the send."""

            def __init__(self, post: Callable[[], Any]) -> None:
                self.work: Any = None

                def posting() -> None:
                    self.work = post()

                self.number = model.queue(posting)

            def wait(self, timeout: timedelta | None = None) -> bool:
                model.wait(self.number)
                return bool(self.work.wait(timeout))

            def is_completed(self) -> bool:
                return self.work is not None and bool(self.work.is_completed())

        def gloo_send(group: StrictNccl, tensor: torch.Tensor, peer: int, tag: int) -> Any:
            return Sent(lambda: real_gloo_send(group, tensor, peer, tag))

        def wait(work: Work, timeout: timedelta | None = None) -> bool:
            for op in work._ops:
                model.queue(op.finish)
            return True

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            model.copy(dst, src, non_blocking, lambda: real_copy(dst, src, non_blocking))
            return dst

        def foreach_copy_(dsts: Any, srcs: Any, non_blocking: bool = False) -> None:
            for dst, src in zip(dsts, srcs):
                copy_(dst, src, non_blocking)

        def allocating(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def allocate(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
                tensor = make(*args, **kwargs)
                if pin_memory:
                    return model.mark(tensor, "pinned")
                if kwargs.get("device") is not None:
                    return model.mark(tensor, "device")
                return tensor

            return allocate

        def pin_memory(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return model.mark(tensor.clone(), "pinned")

        def wire_can_touch(
            lane: Any, tensors: Any
        ) -> bool:  # device memory: stand-in device buffers
            return not tensors or (model.place(tensors[0]) == "device") == lane.nccl

        stream = Stream()
        return {
            (staging, "wire_can_touch"): wire_can_touch,
            (torch, "empty"): allocating(torch.empty),
            (torch, "zeros"): allocating(torch.zeros),
            (torch.Tensor, "pin_memory"): pin_memory,
            (torch.Tensor, "is_pinned"): lambda tensor, *args, **kwargs: (
                model.place(tensor) == "pinned"
            ),
            (torch.Tensor, "copy_"): copy_,
            (torch, "_foreach_copy_"): foreach_copy_,
            (torch.cuda, "Stream"): Stream,
            (torch.cuda, "Event"): Event,
            (torch.cuda, "current_stream"): lambda device=None: stream,
            (torch.cuda, "synchronize"): lambda device=None: model.wait(),
            (Work, "wait"): wait,
            (StrictNccl, "gloo_send"): gloo_send,
        }
