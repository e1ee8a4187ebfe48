"""cudarecv: TensorDict point-to-point transfers over torch.distributed, at wire speed.

Drop-in, wire-compatible versions of tensordict's ``isend/irecv/send/recv``,
with cached plans, a native fast wire (``bucket_bytes``) and fast
pseudo-random tags.

Example:
    >>> import cudarecv
    >>> cudarecv.irecv(td, src=0)                       # as td.irecv(src=0)
    >>> cudarecv.recv(td, src=0, bucket_bytes=1 << 20)  # fast wire, both ends
    >>> with cudarecv.installed():                      # or make them the methods
    ...     td.recv(src=0)

The names below load their module on first use, so ``import cudarecv`` (and
the pytest plugin it ships) does not import torch until something needs it.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# the library's logger stays silent unless the application configures it (see cudarecv.core.log)
logging.getLogger("cudarecv").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "irecv": ".p2p.calls",
    "isend": ".p2p.calls",
    "recv": ".p2p.calls",
    "send": ".p2p.calls",
    "Transfer": ".core.transfer",
    "install": ".p2p.install",
    "installed": ".p2p.install",
    "is_installed": ".p2p.install",
    "uninstall": ".p2p.install",
    "tag_sequence": ".plan.tags",
    "WeightSender": ".weights.sender",
    "store_group": ".core.groups",
    "WeightReceiver": ".weights.receiver",
    "Error": ".core.errors",
    "ArgumentError": ".core.errors",
    "ArgumentTypeError": ".core.errors",
    "UsageError": ".core.errors",
    "WaitTimeout": ".core.errors",
    "MismatchError": ".core.errors",
    "HeaderError": ".core.errors",
    "SchemaError": ".core.errors",
    "PushHeaderError": ".core.errors",
    "ChecksumError": ".core.errors",
    "LinkError": ".core.errors",
    "OutOfStepError": ".core.errors",
    "PeerError": ".core.errors",
    "TransferTimeout": ".core.errors",
    "BrokenError": ".core.errors",
    "KernelCompileError": ".core.errors",
    "SenderClosed": ".core.errors",
    "SenderFenced": ".core.errors",
    "StoreError": ".core.errors",
    "StoreRecordError": ".core.errors",
    "ReceiverFailed": ".core.errors",
    "RelayLost": ".core.errors",
    "start_thread": ".core.shutdown",
}
__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BrokenError",
    "ChecksumError",
    "Error",
    "HeaderError",
    "KernelCompileError",
    "LinkError",
    "MismatchError",
    "OutOfStepError",
    "PeerError",
    "PushHeaderError",
    "ReceiverFailed",
    "RelayLost",
    "SchemaError",
    "SenderClosed",
    "SenderFenced",
    "StoreError",
    "StoreRecordError",
    "Transfer",
    "TransferTimeout",
    "UsageError",
    "WaitTimeout",
    "WeightReceiver",
    "WeightSender",
    "install",
    "installed",
    "irecv",
    "is_installed",
    "isend",
    "recv",
    "send",
    "start_thread",
    "store_group",
    "tag_sequence",
    "uninstall",
]

if TYPE_CHECKING:
    from .core.errors import (
        ArgumentError,
        ArgumentTypeError,
        BrokenError,
        ChecksumError,
        Error,
        HeaderError,
        KernelCompileError,
        LinkError,
        MismatchError,
        OutOfStepError,
        PeerError,
        PushHeaderError,
        ReceiverFailed,
        RelayLost,
        SchemaError,
        SenderClosed,
        SenderFenced,
        StoreError,
        StoreRecordError,
        TransferTimeout,
        UsageError,
        WaitTimeout,
    )
    from .core.groups import store_group
    from .core.shutdown import start_thread
    from .core.transfer import Transfer
    from .p2p.calls import irecv, isend, recv, send
    from .p2p.install import install, installed, is_installed, uninstall
    from .plan.tags import tag_sequence
    from .weights.receiver import WeightReceiver
    from .weights.sender import WeightSender


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cudarecv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
