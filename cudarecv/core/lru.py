"""A bounded cache: what per-call arguments key (tags per ``init_tag``, layouts per piece size)
must not grow with the number of distinct calls."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def lru_get(
    cache: OrderedDict[K, V],
    key: K,
    build: Callable[[], V],
    limit: int,
    evict: Callable[[V], None] | None = None,
) -> V:
    """``cache[key]``, built with ``build()`` on a miss; the least recently used entry goes
    (``evict(value)`` first) once more than ``limit`` are kept.

    Example:
        >>> cache = OrderedDict()
        >>> [lru_get(cache, k, lambda: k * k, limit=2) for k in (1, 2, 3)]
        [1, 4, 9]
        >>> list(cache)
        [2, 3]
    """
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
        return value
    value = cache[key] = build()
    while len(cache) > limit:
        _, old = cache.popitem(last=False)
        if evict is not None:
            evict(old)
    return value
