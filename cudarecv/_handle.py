"""The object an asynchronous call returns: a ``torch.futures.Future`` backed by CUDA events.

A transfer is written as a generator (a *protocol*) that posts sends or
receives and yields the ``Work``-like objects the host must see done before it
can go on; it returns the call's result. :class:`Transfer` drives it: the first
step runs at once (so the call has posted its first messages when it returns),
the rest in :meth:`Transfer.wait` or :meth:`Transfer.done`.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Generator, Sequence

import torch

Protocol = Generator[Sequence[Any], None, Any]


class Transfer(torch.futures.Future):
    """A transfer in flight: a ``torch.futures.Future`` whose value is the received tensordict.

    Returned in a list by ``irecv(return_premature=True)`` and
    ``isend(return_early=True)``. ``wait()`` finishes the transfer; when the
    tensordict is on a GPU it then makes the caller's current stream wait for
    the transfer's CUDA :attr:`event` (the host does not wait for the GPU) and
    returns. ``event`` is ``None`` for transfers that touch no GPU.

    Example:
        >>> [transfer] = cudarecv.irecv(td, src=0, return_premature=True)
        >>> ...  # other work while the bytes travel
        >>> td = transfer.wait()  # the received tensordict (``None`` for a send)
        >>> other_stream.wait_event(transfer.event)  # on a GPU: order another stream too
    """

    def __init__(self, protocol: Protocol, stream: Any = None,
                 on_error: Callable[[BaseException], BaseException] | None = None) -> None:
        super().__init__()
        self._protocol = protocol
        self._stream = stream
        self._on_error = on_error
        self._works: Sequence[Any] = ()
        self._finished = False
        self.failed = False  # whether the transfer ended in an error
        self._driving = threading.Lock()  # one thread advances the protocol at a time
        self.event: Any = None
        self._advance(first=True)

    def _advance(self, first: bool = False) -> None:
        try:
            self._works = next(self._protocol) if first else self._protocol.send(None)
        except StopIteration as stop:
            self._works, self._finished = (), True
            if self._stream is not None:
                self.event = torch.cuda.Event()
                self.event.record(self._stream)
            self.set_result(stop.value)
        except BaseException as error:
            error = self._fail(error)
            if first:
                raise error

    def _fail(self, error: BaseException) -> BaseException:
        """Record the failure (as ``on_error`` rewrites it) and return it."""
        if self._on_error is not None:
            rewritten = self._on_error(error)
            if rewritten is not error:
                rewritten.__cause__ = error
            error = rewritten
        self._works, self._finished, self.failed = (), True, True
        self._protocol.close()
        self.set_exception(error)
        return error

    def done(self) -> bool:
        """Whether the transfer has finished, advancing it if its pending works report completion.

        gloo's send/recv works report completion only inside ``wait()``, so a
        multi-step transfer on gloo advances in :meth:`wait` (another thread may
        call it; see ``WeightReceiver.pull(wait=False)``). For the same reason
        ``torch.futures.wait_all``/``collect_all``/``then`` see the transfer end
        only once something calls :meth:`wait` or :meth:`done`.
        """
        if self._driving.acquire(blocking=False):
            try:
                while not self._finished and all(w.is_completed() for w in self._works):
                    self._advance()
            finally:
                self._driving.release()
        return self._finished and super().done() and (self.event is None or self.event.query())

    is_completed = done

    def wait(self, timeout: float | None = None) -> Any:
        """Finish the transfer and return its result (the tensordict of a receive).

        Args:
            timeout: seconds for the whole transfer (each step waits at most what
                is left); ``None`` leaves it to the process group's own timeout.

        Raises:
            whatever the transfer raised (a header mismatch, a timeout, a dead peer);
            a failed transfer raises the same error on every ``wait()``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._driving.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"the transfer did not finish within {timeout:g} s")
        try:
            self._drive(deadline, timeout)
        finally:
            self._driving.release()
        if self.event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self.event)
        return super().wait()

    def _drive(self, deadline: float | None, timeout: float | None) -> None:
        while not self._finished:
            try:
                for work in self._works:
                    if deadline is None:
                        work.wait()
                    else:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"the transfer did not finish within {timeout:g} s")
                        work.wait(timedelta(seconds=left))
            except BaseException as error:
                self._fail(error)
                break
            self._advance()
