"""Which transport carries a version: the registered transports, and the choice among them, in one place.

Adding a transport (RDMA, say) is a module with a :class:`~.base.Transport` subclass and one :func:`register`
line: a sender offers the first usable one by priority (:func:`choose`), a receiver takes the one whose offer
it is (:func:`accepting`), and the weight-sync modules speak only to the interface.
"""

from __future__ import annotations

from ...samehost import cuda_ipc
from ...samehost.shared_memory import HOST_OFFER, MAX_SEGMENTS
from .base import Need, Transport
from .cuda_ipc import CudaIpc
from .shared_memory import SharedMemory
from .wire import Wire

#: the fallback: every receiver can take it
WIRE = Wire()

_REGISTRY: dict[str, Transport] = {}


def register(transport: Transport) -> None:
    """Make ``transport`` one a sender may choose and a receiver may take (once per name)."""
    if transport.name in _REGISTRY:
        raise ValueError(f"a weight-sync transport named {transport.name!r} is registered already")
    _REGISTRY[transport.name] = transport


def unregister(name: str) -> None:
    """Take back the transport registered as ``name`` (tests)."""
    _REGISTRY.pop(name, None)


def registered() -> list[Transport]:
    """Every transport registered, the one a choice tries first first."""
    return sorted(_REGISTRY.values(), key=lambda t: -t.priority)


register(WIRE)
register(CudaIpc())
register(SharedMemory())


def choose(need: Need) -> Transport:
    """The transport a sender offers its receivers: the first registered one usable in ``need``'s situation, by
    priority; the wire when nothing may be shared (``transport="wire"``, ``CUDARECV_TRANSPORT``) or for a relay
    (its chain moves payloads: no transport that sends headers alone)."""
    if not need.shareable:
        return WIRE
    for transport in registered():
        if need.fanout == "relay" and transport.header_only:
            continue
        if transport.usable(need):
            return transport
    return WIRE


def accepting(offer: bytes) -> Transport | None:
    """Receiver: the transport whose offer ``offer`` is (None if no registered one offers)."""
    return next((t for t in registered() if t is not WIRE and t.takes(offer)), None)


def most_offer_bytes() -> int:
    """The largest same-host offer a receiver reads in the handshake (a larger one is refused)."""
    return max(HOST_OFFER.size_of(MAX_SEGMENTS), cuda_ipc.OFFER.size_of(MAX_SEGMENTS))
