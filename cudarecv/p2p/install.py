"""Make cudarecv's functions the p2p methods of every tensordict class and tensorclass.

The stock methods live on a mixin of ``TensorDictBase``; tensorclasses
delegate them to their inner tensordict. Installing sets cudarecv's versions on
``TensorDictBase`` (and on any subclass that defines its own), so every
``TensorDict``, ``LazyStackedTensorDict``, nested tensordict and tensorclass
instance uses them; uninstalling restores exactly what was there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from tensordict import TensorDictBase

from . import calls

_NAMES = ("isend", "irecv", "send", "recv")
_MISSING = object()
_saved: dict[tuple[type, str], Any] = {}


def _as_method(
    name: str, function: Callable[..., Any], stock: Callable[..., Any]
) -> Callable[..., Any]:
    peer_name = "dst" if name.endswith("send") else "src"

    @functools.wraps(function)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        peer = args[0] if args else kwargs.get(peer_name)
        if _is_pipe(peer):  # UCXX pipes stay with tensordict
            return stock(self, *args, **kwargs)
        return function(self, *args, **kwargs)

    method.__cudarecv__ = True  # type: ignore[attr-defined]
    method.__stock__ = stock  # type: ignore[attr-defined]  # what it replaced (cudarecv.p2p.stock reads it)
    return method


def _is_pipe(peer: Any) -> bool:
    return type(peer).__name__ == "TensorDictPipe"


def _classes() -> list[type]:
    seen, todo = [], [TensorDictBase]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return [c for c in seen if c is TensorDictBase or any(n in vars(c) for n in _NAMES)]


def install() -> None:
    """Route ``isend/irecv/send/recv`` of every tensordict and tensorclass through cudarecv.

    Idempotent; :func:`uninstall` restores the stock methods.

    Example:
        >>> cudarecv.install()
        >>> td.irecv(src=0, bucket_bytes=1 << 20)  # cudarecv.irecv(td, src=0, ...)
    """
    for cls in _classes():
        for name in _NAMES:
            current = vars(cls).get(name, _MISSING)
            if getattr(current, "__cudarecv__", False):
                continue
            _saved[(cls, name)] = current
            setattr(cls, name, _as_method(name, getattr(calls, name), getattr(cls, name)))


def uninstall() -> None:
    """Restore the methods :func:`install` replaced. Idempotent."""
    while _saved:
        (cls, name), original = _saved.popitem()
        if original is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return getattr(vars(TensorDictBase).get("irecv"), "__cudarecv__", False)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Context manager: cudarecv's methods inside, the previous state after.

    Example:
        >>> with cudarecv.installed():
        ...     td.recv(src=0)
    """
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
