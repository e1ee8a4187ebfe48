"""The wire: every version sent on the receiver's link (gloo, or NCCL through the same lanes and staging), in
the push's messages after its header. Every receiver can take it: the fallback of every choice, and the route
of a receiver that took no offer, of a relay chain, and of a snapshot the sender replaced with one of its own.

The link beneath decides what weight sync may do on it, whatever the transport (a CUDA IPC receiver's headers
and words travel on it too): :func:`rules`. NCCL is no transport of its own, only the wire's other matching rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ...core.link import Link
from ...core.protocol import Protocol
from ...core.transfer import WIRE
from ...wire.control import wire_bytes
from ...wire.staging import Lane, send_from
from .base import Need, Transport

if TYPE_CHECKING:
    from ..snapshots import Patch, Snapshot
    from ..wire import SessionTags


class Wire(Transport):
    """The header, then the payload in the push's messages, on the receiver's link."""

    name = WIRE
    patches = True

    def usable(self, need: Need) -> bool:
        return True

    def push(
        self, lane: Lane, snapshot: Snapshot, tags: SessionTags, patch: Patch | None = None
    ) -> Protocol:
        pushed, chunks = (
            (snapshot.pushed, snapshot.chunks) if patch is None else (patch.header, patch.chunks)
        )
        header = [wire_bytes(lane, pushed.pack())]
        # the header's work is waited for after the payload's are posted
        head = yield from send_from(lane, header, [tags.header], defer=True)
        yield from send_from(lane, chunks, [tags.payload] * len(chunks))
        if head:
            yield head


@dataclass(frozen=True)
class LinkRules:
    """What weight sync may do on a link, by how its backend matches messages: gloo by tag, in any order;
    NCCL in posting order on one stream per pair, so a receive left posted blocks the pair's own sends."""

    backend: Literal["gloo", "nccl"]
    #: a receive stays posted between messages: the receiver's header receive (it hears the sender close between
    #: pulls) and the sender's listener of the receiver's words (asks, GOT, BYE); on NCCL the words are read in turn
    standing: bool
    #: latest mode, where a receiver's ask must pass the sender's posted receive
    latest: bool


GLOO = LinkRules("gloo", standing=True, latest=True)
NCCL = LinkRules("nccl", standing=False, latest=False)


def rules(link: Link) -> LinkRules:
    """The rules of ``link``'s backend."""
    return NCCL if link.backend == "nccl" else GLOO
