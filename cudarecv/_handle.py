"""The object an asynchronous call returns: ``wait()`` finishes the transfer.

A transfer is written as a generator (a *protocol*) that posts sends or
receives and yields the list of ``Work`` objects it needs done before it can go
on; it returns the call's result. :class:`Transfer` drives it: the first step
runs at once (so the call has posted its first messages when it returns), the
rest in :meth:`Transfer.wait`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Generator, Sequence

Protocol = Generator[Sequence[Any], None, Any]


class Transfer:
    """A transfer in flight, as returned in a list by ``irecv(return_premature=True)``
    and ``isend(return_early=True)``.

    Example:
        >>> [transfer] = cudarecv.irecv(td, src=0, return_premature=True)
        >>> ...  # other work while the bytes travel
        >>> td = transfer.wait()  # the received tensordict (``None`` for a send)
    """

    def __init__(self, protocol: Protocol) -> None:
        self._protocol = protocol
        self._done = False
        self._error: BaseException | None = None
        self._result: Any = None
        self._works: Sequence[Any] = ()
        self._advance(first=True)

    def _advance(self, first: bool = False) -> None:
        try:
            self._works = next(self._protocol) if first else self._protocol.send(None)
        except StopIteration as stop:
            self._done, self._result, self._works = True, stop.value, ()
        except BaseException as error:
            self._fail(error)
            raise

    def _fail(self, error: BaseException) -> None:
        self._done, self._error, self._works = True, error, ()
        self._protocol.close()

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return without blocking on the wire."""
        if self._done:
            return True
        return all(w.is_completed() for w in self._works) and self._step_if_ready()

    def _step_if_ready(self) -> bool:
        self._advance()
        return self.is_completed()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the transfer is done and return its result.

        Args:
            timeout: seconds to wait for each step, on top of the process group's
                own timeout; ``None`` uses the process group's.

        Raises:
            whatever the transfer raised (a header mismatch, a timeout, a dead peer);
            a failed transfer raises the same error on every ``wait()``.
        """
        while not self._done:
            try:
                for work in self._works:
                    if timeout is None:
                        work.wait()
                    else:
                        work.wait(timedelta(seconds=timeout))
            except BaseException as error:
                self._fail(error)
                raise
            self._advance()
        if self._error is not None:
            raise self._error
        return self._result
