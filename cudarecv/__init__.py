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

# the library's logger stays silent unless the application configures it (see cudarecv._log)
logging.getLogger("cudarecv").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "irecv": "._api",
    "isend": "._api",
    "recv": "._api",
    "send": "._api",
    "Transfer": "._handle",
    "install": "._install",
    "installed": "._install",
    "is_installed": "._install",
    "uninstall": "._install",
    "tag_sequence": "._tags",
    "WeightSender": "._weight_sender",
    "WeightReceiver": "._weight_receiver",
    "Error": "._errors",
    "ArgumentError": "._errors",
    "ArgumentTypeError": "._errors",
    "UsageError": "._errors",
    "WaitTimeout": "._errors",
    "MismatchError": "._errors",
    "HeaderError": "._errors",
    "SchemaError": "._errors",
    "PushHeaderError": "._errors",
    "ChecksumError": "._errors",
    "LinkError": "._errors",
    "OutOfStepError": "._errors",
    "PeerError": "._errors",
    "TransferTimeout": "._errors",
    "BrokenError": "._errors",
    "KernelCompileError": "._errors",
    "SenderClosed": "._errors",
    "ReceiverFailed": "._errors",
}
__all__ = [
    "ArgumentError", "ArgumentTypeError", "BrokenError", "ChecksumError", "Error", "HeaderError",
    "KernelCompileError", "LinkError", "MismatchError", "OutOfStepError", "PeerError", "PushHeaderError",
    "ReceiverFailed", "SchemaError", "SenderClosed", "Transfer", "TransferTimeout", "UsageError", "WaitTimeout", "WeightReceiver",
    "WeightSender", "install", "installed", "irecv", "is_installed", "isend", "recv", "send", "tag_sequence",
    "uninstall",
]

if TYPE_CHECKING:
    from ._api import irecv, isend, recv, send
    from ._errors import (
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
        SchemaError,
        SenderClosed,
        TransferTimeout,
        UsageError,
        WaitTimeout,
    )
    from ._handle import Transfer
    from ._install import install, installed, is_installed, uninstall
    from ._tags import tag_sequence
    from ._weight_receiver import WeightReceiver
    from ._weight_sender import WeightSender

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cudarecv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
