"""The leaf walk: every tensor of a tensordict in the order stock tensordict sends them.

Stock order: the sorted top-level keys, recursing into nested tensordicts and
tensorclasses; a ``LazyStackedTensorDict`` member by member; non-tensor data
(``NonTensorData``, non-tensor fields of a tensorclass) skipped.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.base import NO_DEFAULT
from tensordict.utils import _is_tensorclass
from torch import Tensor

from ..core.errors import ArgumentTypeError

Path = tuple  # a leaf's key path; lazy-stack members appear as int indices


def unwrap(td: Any) -> TensorDictBase:
    """The tensordict behind ``td``: the ``_tensordict`` of a tensorclass, else ``td``."""
    if _is_tensorclass(type(td)):
        return td._tensordict
    if isinstance(td, TensorDictBase):
        return td
    raise ArgumentTypeError(
        f"`td` must be a TensorDict, a LazyStackedTensorDict or a tensorclass instance, "
        f"got {type(td).__name__}"
    )


def walk(td: TensorDictBase) -> tuple[list[Path], list[Tensor]]:
    """The key paths and tensors of the leaves of ``td``, in stock send order.

    Example:
        >>> paths, tensors = walk(TensorDict(b=torch.zeros(2), a=TensorDict(c=torch.ones(1))))
        >>> paths
        [('a', 'c'), ('b',)]
    """
    paths: list[Path] = []
    tensors: list[Tensor] = []
    _walk_into(td, (), paths, tensors)
    return paths, tensors


def _walk_into(td: Any, prefix: Path, paths: list[Path], tensors: list[Tensor]) -> None:
    if _is_tensorclass(type(td)):
        td = td._tensordict
    if isinstance(td, LazyStackedTensorDict):
        for index, member in enumerate(td.tensordicts):
            _walk_into(member, prefix + (index,), paths, tensors)
        return
    if type(td) is TensorDict:
        items = td._tensordict
        keys = sorted(items)
        get = items.__getitem__
    else:
        keys = td.sorted_keys

        def get(key: str) -> Any:
            return td._get_str(key, NO_DEFAULT)

    for key in keys:
        value = get(key)
        path = prefix + (key,)
        if isinstance(value, Tensor):
            paths.append(path)
            tensors.append(value)
        elif isinstance(value, TensorDictBase) or _is_tensorclass(type(value)):
            _walk_into(value, path, paths, tensors)
        else:
            raise ArgumentTypeError(
                f"leaf {format_path(path)!r} is a {type(value).__name__}, which cannot travel: "
                "only tensors, tensordicts, tensorclasses and non-tensor data are supported"
            )


class Skeleton:
    """What a walk of plain (not lazy-stacked, not tensorclass) tensordicts saw: each one's dict of
    entries, its keys in order and its values, to tell without walking again that nothing moved
    (``unchanged``: about 0.1 ms for 2000 leaves, a walk about 1.5 ms).

    The tensordicts themselves are held weakly (a plan cache entry must not keep them alive).
    """

    def __init__(self, nodes: list[tuple[weakref.ref, dict, list, list]]) -> None:
        self._nodes = nodes

    @classmethod
    def of(cls, td: TensorDictBase) -> Skeleton | None:
        """The skeleton of ``td``, or None if it holds anything but plain tensordicts and tensors."""
        nodes: list[tuple[weakref.ref, dict, list, list]] = []
        pending = [td]
        while pending:
            node = pending.pop()
            if type(node) is not TensorDict:
                return None
            items = node._tensordict
            values = list(items.values())
            for value in values:
                if isinstance(value, TensorDictBase) or _is_tensorclass(type(value)):
                    pending.append(value)
                elif not isinstance(value, Tensor):
                    return None
            nodes.append((weakref.ref(node), items, list(items), values))
        return cls(nodes)

    def unchanged(self, td: TensorDictBase) -> bool:
        """Whether ``td`` (the root this was made of) still holds the same keys and values, in the same order."""
        if self._nodes[0][0]() is not td:
            return False
        for ref, items, keys, values in self._nodes:
            node = ref()
            if (
                node is None
                or node._tensordict is not items
                or len(items) != len(keys)
                or list(items) != keys
                or not all(map(operator.is_, items.values(), values))
            ):
                return False
        return True


def format_path(path: Path) -> str:
    """``('a', 0, 'b')`` -> ``'a[0].b'``: a leaf's name for messages."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
