"""The stock tensordict wire: one message per leaf with its tag, or one consolidated message.

What goes over the wire here is byte for byte what tensordict 0.15.3 sends, so
either end can be a stock peer. The messages of one call are posted at once
on the group object itself, which works for registered and standalone groups
alike (``P2POp`` refuses standalone ones).
"""

from __future__ import annotations

from torch import Tensor

from ._handle import Protocol
from ._link import Link

CONSOLIDATED_TAG = 0  # stock sends the consolidated storage with tag 0


def send_leaves(link: Link, tensors: list[Tensor], tags: list[int]) -> Protocol:
    send, peer = link.pg.send, link.peer
    yield [send([t], peer, tag) for t, tag in zip(tensors, tags)]


def recv_leaves(link: Link, tensors: list[Tensor], tags: list[int], result: object) -> Protocol:
    recv, peer = link.pg.recv, link.peer
    yield [recv([t], peer, tag) for t, tag in zip(tensors, tags)]
    return result


def send_storage(link: Link, storage: Tensor) -> Protocol:
    yield [link.pg.send([storage], link.peer, CONSOLIDATED_TAG)]


def recv_storage(link: Link, storage: Tensor, result: object) -> Protocol:
    yield [link.pg.recv([storage], link.peer, CONSOLIDATED_TAG)]
    return result
