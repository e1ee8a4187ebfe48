"""Every exception cudarecv raises: one family under :class:`Error`.

Each class keeps the builtin base callers expect (``ValueError`` for bad
arguments, ``TimeoutError`` for timeouts, ...) and says, as a class property,
whether the link it happened on (the peer pair and process group) still works:
``link_usable``. Nothing is classified by its message.

::

    Error
    ├── ArgumentError (ValueError), ArgumentTypeError (TypeError)   bad input, raised before anything is sent
    ├── UsageError (RuntimeError)             a call that cannot run now (no process group, no CUDA, closed)
    │   └── SenderClosed                      a weight sender closed: no version comes any more
    │       └── SenderFenced                  a named sender whose name a newer sender took: it closed
    ├── ReceiverFailed (RuntimeError)         a weight receiver could not start, and said why
    ├── WaitTimeout (TimeoutError)            a caller's wait ran out; the transfer goes on
    ├── RelayLost (RuntimeError)              a relayed version did not come: a hop before this one failed
    ├── StoreError (RuntimeError)             the store named senders are joined through failed
    │   └── StoreRecordError                  a record in it that cudarecv did not write (named by its key)
    ├── MismatchError (ValueError)            the peer's message does not match; drained, nothing written
    │   ├── HeaderError                       fast wire
    │   ├── SchemaError                       weight-sync handshake (refused on both sides)
    │   ├── PushHeaderError, ChecksumError    weight-sync push (the last version stays published)
    ├── LinkError (RuntimeError)              link_usable = False: use new process groups
    │   ├── OutOfStepError                    a message of another protocol, or lengths past the bounds
    │   ├── PeerError                         the peer died or the connection broke
    │   ├── TransferTimeout (TimeoutError)    the transfer's own time ran out
    │   └── BrokenError                       a weight receiver after one of the above
    └── KernelCompileError (RuntimeError)     NVRTC rejected a kernel

Example:
    >>> try:
    ...     cudarecv.recv(td, src=0, bucket_bytes=1 << 20, timeout=5.0)
    ... except cudarecv.Error as error:
    ...     if not error.link_usable:
    ...         ...  # build new process groups
"""

from __future__ import annotations


class Error(Exception):
    """The base of every exception cudarecv raises.

    ``link_usable``: whether the link (peer pair and process group) still works
    after this error, so the next transfer on it can go ahead.
    """

    link_usable: bool = True


class ArgumentError(Error, ValueError):
    """A bad argument value, named with its fix; raised before anything is sent or written."""


class ArgumentTypeError(Error, TypeError):
    """An argument of the wrong type, named with its fix; raised before anything is sent or written."""


class UsageError(Error, RuntimeError):
    """A call that cannot run in this state (no process group, no CUDA, closed, nothing received yet)."""


class SenderClosed(UsageError):
    """The :class:`~cudarecv.WeightSender` closed: no version comes any more; the last one
    received stays readable in ``receiver.td``."""


class SenderFenced(SenderClosed):
    """A :class:`~cudarecv.WeightSender` built with ``store`` and ``name`` found that a newer sender took its name
    (a trainer started again while this one still ran): it closed, so that its receivers move to the newer one
    and no receiver ever goes back to older weights. Run one trainer per name."""


class ReceiverFailed(Error, RuntimeError):
    """A weight receiver could not start (no CUDA, no memory, a bad argument...) and answered
    the handshake with its reason; both sides raise. The link is in step."""


class WaitTimeout(Error, TimeoutError):
    """A caller's ``wait(timeout)`` ran out before the transfer ended; the transfer goes on."""


class RelayLost(Error, RuntimeError):
    """A weight-sync version relayed through a chain of receivers did not reach this one: a receiver before it
    in the chain died, stopped or timed out during the push. This receiver's links are in step and it stays
    served: the next version comes through the chain healed around the failed one (its last version stays
    published). On the sender: the receivers after the failed one that did not get the version."""


class StoreError(Error, RuntimeError):
    """The store through which receivers join a named sender (``ElasticSender(td, store, name)``) failed: its
    server is gone or unreachable. ``key``: the key being read or written. No weight-sync link is concerned (a
    sender already joined goes on serving without the store)."""

    key: str | None = None

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StoreRecordError(StoreError):
    """A record in that store that cudarecv did not write (not JSON, a wrong field, a value out of bounds):
    another program uses the same keys, or the store was tampered with. The message names the key and the fix."""


class MismatchError(Error, ValueError):
    """The peer's message does not match this side; it was drained and nothing was written."""


class HeaderError(MismatchError):
    """A fast-wire header that does not match the receiver's tensordict (payload drained)."""


class SchemaError(MismatchError):
    """The two ends of a weight sync disagree on the weights' structure (both sides raise)."""


class PushHeaderError(MismatchError):
    """A weight-sync push refused (wrong fingerprint or version; drained, last version kept)."""


class ChecksumError(MismatchError):
    """A weight-sync push whose BLAKE3 digest does not match its header (last version kept)."""


class LinkError(Error, RuntimeError):
    """The link failed or is out of step: messages may still arrive for what was posted; use new
    process groups (gloo cannot take back a posted receive)."""

    link_usable = False


class OutOfStepError(LinkError):
    """A message that is not what this protocol expects (another protocol or version, or lengths
    past the bounds): refused before anything is sized from it, not drained."""


class PeerError(LinkError):
    """The peer died or the connection to it broke."""


class TransferTimeout(LinkError, TimeoutError):
    """The transfer's own time (its ``timeout``, or the process group's) ran out.

    ``stage``: what it waited for then, where its protocol said (e.g. the drain of a mismatched payload);
    ``in_flight``: whether messages it posted were still in flight (not when it waited for its turn).
    """

    stage: str | None = None
    in_flight: bool = True


class BrokenError(LinkError):
    """A weight receiver that failed before (a timeout, a dead sender, a lie): close it."""


class KernelCompileError(Error, RuntimeError):
    """NVRTC rejected a kernel source; the message carries the NVRTC log."""
