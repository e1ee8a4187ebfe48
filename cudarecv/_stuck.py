"""Tensordicts whose transfer failed on a link while its messages may still move.

gloo cannot take back a posted receive or send: after a transfer of ``td`` on a
link timed out, or the link failed, a late message could still land in ``td``'s
leaves or be matched by its next transfer on that link (stale bytes). So the
next call with ``td`` on that link (peer pair and group) raises
:class:`~cudarecv.LinkError` at once, naming why; other tensordicts, and ``td``
on other links (new process groups), are not affected.
"""

from __future__ import annotations

import weakref
from typing import Any

from ._errors import LinkError
from ._link import Link

# id(td) -> (weakref to td, {(id(group), peer): (weakref to the group, why)}); held weakly, the group is
# collectable once destroyed (its id may then be another group's: the weakref tells them apart)
_STUCK: dict[int, tuple[weakref.ref, dict[tuple[int, int], tuple[weakref.ref, str]]]] = {}


def mark(td: Any, link: Link, why: str) -> None:
    """Refuse further transfers of ``td`` on ``link``, saying ``why``."""
    key = id(td)
    entry = _STUCK.get(key)
    if entry is None or entry[0]() is not td:
        entry = _STUCK[key] = (weakref.ref(td, lambda _, key=key: _STUCK.pop(key, None)), {})
    entry[1][(id(link.pg), link.peer)] = (weakref.ref(link.pg), why)


def check(td: Any, link: Link) -> None:
    """Raise :class:`LinkError` if an earlier transfer of ``td`` on ``link`` left messages behind."""
    entry = _STUCK.get(id(td))
    if entry is None or entry[0]() is not td:
        return
    found = entry[1].get((id(link.pg), link.peer))
    if found is not None and found[0]() is link.pg:
        raise LinkError(
            f"an earlier transfer of this tensordict with rank {link.peer} failed ({found[1]}); a late message "
            "of it may still land or be taken by the next one, so this link is not used for it again: build "
            "new process groups (or use another tensordict)"
        )
