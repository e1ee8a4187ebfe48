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
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "irecv": "._api",
    "isend": "._api",
    "recv": "._api",
    "send": "._api",
    "Transfer": "._handle",
    "HeaderError": "._header",
    "install": "._install",
    "installed": "._install",
    "is_installed": "._install",
    "uninstall": "._install",
    "tag_sequence": "._tags",
    "WeightSender": "._weights",
    "WeightReceiver": "._weights",
    "ChecksumError": "._weights",
    "SchemaError": "._weights_wire",
    "PushHeaderError": "._weights_wire",
}
__all__ = [
    "ChecksumError", "HeaderError", "PushHeaderError", "SchemaError", "Transfer", "WeightReceiver",
    "WeightSender", "install", "installed", "irecv", "is_installed", "isend", "recv", "send",
    "tag_sequence", "uninstall",
]

if TYPE_CHECKING:
    from ._api import irecv, isend, recv, send
    from ._handle import Transfer
    from ._header import HeaderError
    from ._install import install, installed, is_installed, uninstall
    from ._tags import tag_sequence
    from ._weights import ChecksumError, WeightReceiver, WeightSender
    from ._weights_wire import PushHeaderError, SchemaError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cudarecv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
