"""Tensordicts and tags whose transfer failed on a link while its messages may still move.

gloo cannot take back a posted receive or send: after a transfer of ``td`` on a
link timed out, or the link failed, a late message could still land in ``td``'s
leaves, so the next call with ``td`` on that link (peer pair and group) raises
:class:`~cudarecv.LinkError` at once, naming why. After a timeout the peer's part
may also still come, or ours still go, on the transfer's tags, and messages with
one tag are matched in order: the next transfer in the same direction on one of
those tags, whatever its tensordict, would take the stale message (or the stale
receive its own). So such a call is refused at once too; other tags (another
``init_tag``), and new process groups, are not affected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, TypeVar

from .errors import LinkError
from .link import Link

K = TypeVar("K", bound=Hashable)

# id(td) -> (weakref to td, {(id(group), peer): (weakref to the group, why)}); held weakly, the group is
# collectable once destroyed (its id may then be another group's: the weakref tells them apart)
_STUCK: dict[int, tuple[weakref.ref, dict[tuple[int, int], tuple[weakref.ref, str]]]] = {}
# (id(group), peer, sending) -> (weakref to the group, [(a failed transfer's tags, why)]), gone with the group
_TAGS: dict[tuple[int, int, bool], tuple[weakref.ref, list[tuple[Collection[int], str]]]] = {}


def _forgetting(table: dict[K, Any], key: K) -> Callable[[object], None]:
    """A weakref callback that drops ``table[key]`` once its referent is gone."""

    def forget(_: object) -> None:
        table.pop(key, None)

    return forget


def mark(td: Any, link: Link, why: str, tags: Sequence[int] = (), sending: bool = False) -> None:
    """Refuse further transfers of ``td`` on ``link``, and those of any tensordict in the same direction
    (``sending``) on one of ``tags``, saying ``why``."""
    key = id(td)
    entry = _STUCK.get(key)
    if entry is None or entry[0]() is not td:
        entry = _STUCK[key] = (weakref.ref(td, _forgetting(_STUCK, key)), {})
    entry[1][(id(link.pg), link.peer)] = (weakref.ref(link.pg), why)
    if tags:
        _taken(link, sending).append((tags if isinstance(tags, range) else frozenset(tags), why))


def _taken(link: Link, sending: bool) -> list[tuple[Collection[int], str]]:
    """The failed transfers' tags on ``link`` in one direction (a new list for a new group)."""
    key = (id(link.pg), link.peer, sending)
    entry = _TAGS.get(key)
    if entry is None or entry[0]() is not link.pg:
        entry = _TAGS[key] = (weakref.ref(link.pg, _forgetting(_TAGS, key)), [])
    return entry[1]


def check(td: Any, link: Link, tags: Sequence[int] = (), sending: bool = False) -> None:
    """Raise :class:`LinkError` if an earlier transfer of ``td`` on ``link``, or one in the same direction
    on any of ``tags`` there, left messages behind."""
    entry = _STUCK.get(id(td))
    found = (
        None if entry is None or entry[0]() is not td else entry[1].get((id(link.pg), link.peer))
    )
    if found is not None and found[0]() is link.pg:
        raise LinkError(
            f"an earlier transfer of this tensordict with rank {link.peer} failed ({found[1]}); a late message "
            "of it may still land or be taken by the next one, so this link is not used for it again: build "
            "new process groups (or use another tensordict)"
        )
    failed = _TAGS.get((id(link.pg), link.peer, sending))
    if failed is None or failed[0]() is not link.pg:
        return
    for taken, why in failed[1]:
        tag = _shared(taken, tags)
        if tag is not None:
            raise LinkError(
                f"an earlier {'send to' if sending else 'receive from'} rank {link.peer} on tag {tag} failed ({why}); "
                "a late message of it may still be taken by this transfer, or take its messages, so that tag is not "
                "used on this link again: pass another init_tag (tags apart from the failed transfer's), or build "
                "new process groups"
            )


def _shared(taken: Collection[int], tags: Sequence[int]) -> int | None:
    """A tag in both (None if none)."""
    if isinstance(taken, range) and isinstance(tags, range):
        low, high = (
            max(taken.start, tags.start),
            min(taken.stop, tags.stop),
        )  # (step 1: plan.tags' ranges)
        return low if low < high else None
    return next((tag for tag in tags if tag in taken), None)
