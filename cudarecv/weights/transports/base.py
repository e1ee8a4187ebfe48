"""What a weight-sync transport is: :class:`Transport`, the one interface the weight-sync protocol speaks to
about the route a version takes to a receiver, and :class:`Need`, what the choice of one looks at.

A sender picks one transport for its snapshots at construction (:func:`~.registry.choose`); each receiver then
takes its offer at the handshake (:func:`~.registry.accepting`) or stays on the wire. What varies between
transports, and only that, is here: where the snapshots live and what the handshake offers of them (sender), what
a push sends on the link (the payload, or its header alone), what the transport can do (relay, zero copy, a
snapshot written again while a dropped receiver may still read it), and where a version lands (receiver). The
handshake, the pushes, the receivers' words, relay fan-out and the drop policy stay in the weight-sync modules.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...core.protocol import Protocol
from ...wire.control import wire_bytes
from ...wire.staging import Lane, send_from

if TYPE_CHECKING:
    from ..slots import Slot
    from ..snapshots import Patch, Snapshot
    from ..wire import SessionTags


@dataclass(frozen=True)
class Need:
    """What a sender's choice of transport looks at (:func:`~.registry.choose`)."""

    #: where the weights live
    device: torch.device
    #: the backends of its links to the receivers (``"gloo"``, ``"nccl"``); none for receivers joining by store
    backends: tuple[str, ...]
    #: receivers join through a store (each on a gloo pair of its own)
    elastic: bool
    #: the fan-out asked for: a relay moves chunks hop to hop, so it takes a transport that sends payloads
    fanout: str
    #: the caller's ``transport`` (``"auto"``, ``"wire"``), and ``CUDARECV_TRANSPORT``: may anything be shared
    shareable: bool


class Transport(ABC):
    """One route a version takes from a sender's snapshot to a receiver (see the module docstring).

    Transports hold no per-sender state (one instance each, registered once); what a sender or receiver keeps
    (segments, mappings) is handed to them."""

    #: what it is called in ``WeightSender.transports`` and ``WeightReceiver.transport``
    name: ClassVar[str]
    #: which registered transport a choice tries first (the wire, the fallback, is 0)
    priority: ClassVar[int] = 0
    #: a push to a receiver on it sends the header alone (it reads the snapshot where it lies, and says GOT);
    #: a relay chain cannot carry it (relay fan-out moves payloads), so a receiver on it goes on the wire there
    header_only: ClassVar[bool] = False
    #: sync mode's snapshots (one, rewritten by every push, unless receivers may hold them)
    sync_snapshots: ClassVar[int] = 1
    #: a receiver on it may publish a version where it lies (``zero_copy=True``)
    zero_copy: ClassVar[bool] = False
    #: a receiver's copy checks the snapshot's stamps, so a snapshot a dropped receiver may still read is written
    #: again (its copy, overtaken, is never published); else such a snapshot is replaced
    stamped: ClassVar[bool] = False
    #: its snapshots are host memory that receivers copy from while the sender writes: one thread writes them
    host_memory: ClassVar[bool] = False
    #: delta: :meth:`push` takes a ``patch`` to send instead of the version (the others get the version whole)
    patches: ClassVar[bool] = False

    # -- the choice ----------------------------------------------------------------------------------------------
    @abstractmethod
    def usable(self, need: Need) -> bool:
        """Whether a sender in ``need``'s situation can offer this transport (on this machine, now)."""

    def offered_on(self, backend: str) -> bool:
        """Whether the handshake on a link of ``backend`` carries this transport's offer."""
        return True

    def takes(self, offer: bytes) -> bool:
        """Receiver: whether ``offer`` (a handshake's same-host offer) is this transport's."""
        return False

    # -- the sender ----------------------------------------------------------------------------------------------
    def segments(self, total: int, device: torch.device, count: int) -> list[Any]:
        """``count`` storages of ``total`` bytes that receivers may read where they lie (none: the sender's own)."""
        return []

    def offer(self, segments: list[Any]) -> bytes:
        """What a receiver needs to read ``segments`` (sent in the handshake; empty: nothing to offer)."""
        return b""

    def warm(self, segments: list[Any], zero_copy: bool) -> None:
        """Sync mode, once the first receivers took the offer: make the first push's writes cheap."""
        return None  # (nothing to do for most)

    def before_write(self, segment: Any, version: int) -> None:
        """A push starts writing ``version`` into ``segment``."""
        return None  # (nothing to do for most)

    def after_write(self, segment: Any, version: int, stream: Any) -> None:
        """A push wrote ``version`` into ``segment`` (queued on ``stream`` for GPU weights)."""
        return None  # (nothing to do for most)

    def carries(self, snapshot: Snapshot) -> bool:
        """Whether a push of ``snapshot`` to a receiver on this transport goes by it (else: by the wire)."""
        return True

    @abstractmethod
    def push(
        self, lane: Lane, snapshot: Snapshot, tags: SessionTags, patch: Patch | None = None
    ) -> Protocol:
        """A sub-protocol: what a push of ``snapshot`` sends on ``lane`` (star fan-out): ``patch`` instead of the
        version where given (delta: only to a transport whose :attr:`patches` says it takes one; the others are
        called without it). A header-only transport returns the header's send works, posted and not waited for
        (the receiver's GOT is waited for first)."""

    # -- the receiver --------------------------------------------------------------------------------------------
    def map(self, offer: bytes, total: int, device: torch.device | None) -> list[Any]:
        """Receiver: open what ``offer`` names (each of ``total`` bytes); raises with why it cannot."""
        raise NotImplementedError(f"the {self.name} transport offers nothing to map")

    def land(
        self, mapping: Any, slot: Slot, total: int, version: int, lane: Lane, held: int
    ) -> Protocol:
        """Receiver, a sub-protocol: copy ``version`` (``total`` bytes) out of ``mapping`` into ``slot`` and return
        the slot to publish (``held``: the version published, for the error); raises if a newer write overtook
        the copy."""
        raise NotImplementedError(f"the {self.name} transport sends its payloads")
        yield  # (a generator)

    def lies_whole(self, mapping: Any, version: int) -> bool:
        """Receiver, zero copy: whether ``mapping`` holds ``version`` whole, written and not being rewritten."""
        return False


class HeaderOnly(Transport):
    """A transport whose snapshots lie in segments that receivers on the sender's machine read: a push sends the
    header alone, naming the segment, and the receiver answers GOT once it has the version."""

    header_only = True

    def carries(self, snapshot: Snapshot) -> bool:
        # a snapshot the sender replaced with one of its own (a dropped receiver may still read the segment's)
        # lies in no segment: it goes on the wire
        return snapshot.segment is not None

    def push(
        self, lane: Lane, snapshot: Snapshot, tags: SessionTags, patch: Patch | None = None
    ) -> Protocol:
        assert patch is None, "a header-only transport sends no payload, nor a patch"
        segment = snapshot.segment
        assert segment is not None, (
            "a push by a segment of a snapshot in none"
        )  # (carries() said it is in one)
        header = dataclasses.replace(snapshot.pushed, shared=True, segment=segment)
        # (deferred: the push waits for the receiver's GOT, bounded, before it waits on this send, which has ended
        # by then; a gloo send is never given a timeout)
        return (
            yield from send_from(lane, [wire_bytes(lane, header.pack())], [tags.header], defer=True)
        )
