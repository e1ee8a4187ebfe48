"""Stock tensordict on every supported version (0.14.3 to 0.15.x): its p2p methods and tag generator.

tensordict 0.15 keeps ``isend/irecv/send/recv`` on a mixin of ``TensorDictBase``
and names its tag generator ``_int_generator``; 0.14.3 defines them on
``TensorDictBase`` itself, names the generator ``int_generator`` and gives its
``isend/irecv`` no ``consolidated`` keyword (its ``send/recv`` have one). The
wire is the same on both. This module is the one place that knows.

Example:
    >>> from cudarecv.p2p.stock import Stock
    >>> Stock.send(td, dst=1, consolidated=True)  # tensordict's own send, even with cudarecv installed
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase

try:  # tensordict >= 0.15
    from tensordict.utils import _int_generator as int_generator
except ImportError:  # tensordict 0.14
    from tensordict.utils import int_generator  # type: ignore[no-redef]

__all__ = ["STOCK_CONSOLIDATED_ISEND", "Stock", "int_generator"]

try:  # tensordict >= 0.15: the methods live on a mixin that installing never touches
    from tensordict._base.distributed import _Distributed as _holder
except ImportError:  # tensordict 0.14: on TensorDictBase, where install() puts cudarecv's
    _holder = TensorDictBase  # type: ignore[misc]


def _original(name: str) -> Callable[..., Any]:
    method = vars(_holder)[name]
    return getattr(
        method, "__stock__", method
    )  # installed before this module loaded: what it replaced


class Stock:
    """tensordict's own ``isend/irecv/send/recv``, as they were before :func:`cudarecv.install`.

    Call them unbound: ``Stock.irecv(td, src=0)``.
    """

    isend = staticmethod(_original("isend"))
    irecv = staticmethod(_original("irecv"))
    send = staticmethod(_original("send"))
    recv = staticmethod(_original("recv"))


#: Whether stock ``isend/irecv`` take ``consolidated=`` (tensordict >= 0.15); ``send/recv`` always do.
STOCK_CONSOLIDATED_ISEND: bool = "consolidated" in inspect.signature(Stock.isend).parameters
