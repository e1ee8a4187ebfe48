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
"""

from ._api import irecv, isend, recv, send
from ._handle import Transfer
from ._header import HeaderError
from ._install import install, installed, is_installed, uninstall
from ._tags import tag_sequence

__all__ = [
    "HeaderError",
    "Transfer",
    "install",
    "installed",
    "irecv",
    "is_installed",
    "isend",
    "recv",
    "send",
    "tag_sequence",
    "uninstall",
]
__version__ = "0.1.0"
