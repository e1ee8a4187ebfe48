"""What may share memory on this machine (the calls' ``transport``, ``CUDARECV_TRANSPORT``), the kinds of memory
a link shares, and the log of what each link direction chose, and why."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Literal, get_args

import torch

from ..core.errors import ArgumentError
from ..core.host_copy import direct_read_setting
from ..core.link import Link
from ..core.log import logger
from ..core.transfer import WIRE
from . import cuda_ipc
from .shared_memory import available

#: a call's ``transport``: "auto" lets a same-host transport carry the payload, "wire" never does
TransportPolicy = Literal["auto", "wire"]
TRANSPORTS: tuple[TransportPolicy, ...] = get_args(TransportPolicy)
#: ``CUDARECV_TRANSPORT=wire`` turns every same-host transport off (the default, ``auto``, allows them)
ENV = "CUDARECV_TRANSPORT"
#: a side's channels: the kinds of memory it shares
Kind = Literal["host", "device"]
HOST: Kind = "host"
DEVICE: Kind = "device"
#: which end of a link direction a side is
Role = Literal["send", "recv"]
STOP_WAIT = 1.0  # seconds a side's closing waits for its (idle) thread to end


def check_transport(transport: object) -> TransportPolicy:
    """``transport`` is one of :data:`TRANSPORTS`, and the environment's settings are valid (checked here, with
    the arguments: a receiver's refusal then reaches its sender)."""
    known = _known(transport)
    if known is None:
        raise ArgumentError(
            f'`transport` must be one of {TRANSPORTS} ("auto": shared memory with a cudarecv peer on this '
            f'machine, else the wire; "wire": always the socket or NCCL), got {transport!r}'
        )
    _environment()
    return known


def _known(value: object) -> TransportPolicy | None:
    """``value`` as one of :data:`TRANSPORTS`, or None."""
    return next((t for t in TRANSPORTS if isinstance(value, str) and value == t), None)


def _environment() -> TransportPolicy:
    """:data:`ENV`, checked, and the direct route's variable, ``CUDARECV_DIRECT_READ``, with it."""
    env = os.environ.get(ENV, "auto")
    known = _known(env)
    if known is None:
        raise ArgumentError(f"the environment variable {ENV}={env!r} must be one of {TRANSPORTS}")
    direct_read_setting()
    return known


def allowed(transport: str) -> bool:
    """Whether ``transport`` and the environment (:data:`ENV`) allow a same-host transport (checked before
    anything is sent)."""
    return _environment() == "auto" and transport == "auto"


def kind_of(device: torch.device) -> Kind:
    """The channel of memory on ``device``: :data:`HOST` or :data:`DEVICE`."""
    return HOST if device.type == "cpu" else DEVICE


def unavailable(device: torch.device) -> str | None:
    """Why memory on ``device`` cannot be shared with a process of this machine, or None."""
    return available() if device.type == "cpu" else cuda_ipc.available(device)


class Carried:
    """Which transport a transfer's payload took (decided as it runs); read as ``Transfer.transport``."""

    def __init__(self) -> None:
        self.transport = WIRE
        self.waiting = False  # whether a receive still waits for its turn (nothing posted)
        #: what it waits behind while ``waiting`` (for its timeout's message): the link's thread (a same-host
        #: link takes its receives one at a time), or the earlier receives on its tags
        self.behind = "thread"


# what was logged, per group: (peer, role, reason)
_SAID: weakref.WeakKeyDictionary[Any, set[tuple[int, Role, str]]] = weakref.WeakKeyDictionary()
_SAID_LOCK = threading.Lock()


def chose(link: Link, role: Role, transport: str, reason: str) -> None:
    """Log the transport a link direction takes, and why (once per link, role and reason)."""
    with _SAID_LOCK:
        said = _SAID.setdefault(link.pg, set())
        if (link.peer, role, reason) in said:
            return
        said.add((link.peer, role, reason))
    logger.info(
        "%s rank %d of a %s group: %s (%s)",
        "sending to" if role == "send" else "receiving from",
        link.peer,
        link.backend,
        transport,
        reason,
    )
