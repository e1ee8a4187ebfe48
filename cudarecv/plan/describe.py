"""A tensordict's layout in words: what a fast-wire sender tells its receiver once per link and schema, so that a
mismatch names the first key that differs and how, on both sides, instead of two fingerprints.

The header carries only a 16-byte fingerprint of the schema (:func:`~cudarecv.plan.header.schema_digest`). The
first time a link carries a schema, the sender also sends its *description* (:func:`describe`: per leaf its key
path, dtype, shape, bytes and, consolidated, its offset in the storage; zlib-compressed JSON, never pickle) after
the header on the header's tag (:mod:`cudarecv.wire.layouts`), which the receiver keeps. On a mismatch the receiver
compares it with its own (:func:`difference`). A description read from the wire is untrusted: it is bounded,
parsed and checked (:func:`parse`), and one that is not a description is ignored (the mismatch is then said by
fingerprint, as before); it never changes what is received.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .walk import Path, format_path

#: the most bytes a description may take on the wire, and once unpacked (a receiver refuses a longer one)
MAX_DESCRIPTION = 16 << 20
_KINDS = {
    1: "buckets (non-consolidated)",
    2: "chunks (consolidated)",
}  # (plan.header's kinds, by number)


@dataclass(frozen=True)
class Leaf:
    """One leaf as a description says it."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None = None  # its byte offset in the consolidated storage (chunks)

    def words(self) -> str:
        where = "" if self.offset is None else f" at byte {self.offset} of the storage"
        return f"shape {list(self.shape)} {self.dtype} ({self.nbytes} bytes){where}"


@dataclass(frozen=True)
class Layout:
    """A tensordict's layout as a description says it: its payload's kind, its leaves in send order, and (chunks)
    its storage's bytes."""

    kind: int
    leaves: tuple[Leaf, ...]
    storage: int | None = None


def describe(
    kind: int,
    paths: Sequence[Path],
    tensors: Sequence[Tensor],
    offsets: Sequence[int] | None = None,
    storage_bytes: int | None = None,
) -> bytes:
    """The description of a plan's leaves (``offsets`` and ``storage_bytes``: a consolidated storage's), as bytes
    for the wire."""
    leaves = [
        [
            format_path(path),
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            t.numel() * t.element_size(),
            None if offsets is None else offsets[i],
        ]
        for i, (path, t) in enumerate(zip(paths, tensors))
    ]
    text = json.dumps(
        {"kind": int(kind), "leaves": leaves, "storage": storage_bytes}, separators=(",", ":")
    )
    return zlib.compress(text.encode(), 1)


def parse(raw: bytes) -> Layout | None:
    """A description read from the wire, checked; None if it is not one (too long, not zlib, not JSON, not of
    this form)."""
    try:
        inflate = zlib.decompressobj()
        text = inflate.decompress(raw, MAX_DESCRIPTION)
        if inflate.unconsumed_tail or not inflate.eof:
            return None  # longer than a description may be, or cut short
        data = json.loads(text)
        leaves = tuple(_leaf(item) for item in data["leaves"])
        storage = data["storage"]
        if data["kind"] not in _KINDS or not (storage is None or _count(storage)):
            return None
        return Layout(data["kind"], leaves, storage)
    except (zlib.error, ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _leaf(item: Any) -> Leaf:
    path, dtype, shape, nbytes, offset = item
    if not (
        isinstance(path, str)
        and isinstance(dtype, str)
        and isinstance(shape, list)
        and all(map(_count, shape))
        and _count(nbytes)
        and (offset is None or _count(offset))
    ):
        raise ValueError("not a described leaf")
    return Leaf(path, dtype, tuple(shape), nbytes, offset)


def difference(sender: Layout, receiver: Layout) -> str | None:
    """The first difference between the sender's layout and this receiver's, in words naming the key and both
    sides (None if they are alike): a key one side lacks, or another dtype, shape or size, in send order; only then
    (consolidated) a leaf's place in the storage, which moves with the sizes before it, or the storage's size."""
    if sender.kind != receiver.kind:
        return f"the sender sends {_KINDS[sender.kind]}; this tensordict expects {_KINDS[receiver.kind]}"
    theirs = {leaf.path: leaf for leaf in sender.leaves}
    ours = {leaf.path: leaf for leaf in receiver.leaves}
    for i in range(max(len(sender.leaves), len(receiver.leaves))):
        s = sender.leaves[i] if i < len(sender.leaves) else None
        r = receiver.leaves[i] if i < len(receiver.leaves) else None
        if s is not None and s.path not in ours:
            return f"key {s.path!r}: the sender sends it ({s.words()}); this tensordict has no such key"
        if r is not None and r.path not in theirs:
            return f"key {r.path!r}: this tensordict has it ({r.words()}); the sender sends no such key"
        if s is None or r is None or s.path != r.path:  # (the same keys in another order)
            return (
                f"leaf {i}: the sender sends key {s.path if s else None!r} there, this tensordict has "
                f"{r.path if r else None!r}"
            )
        if (s.dtype, s.shape, s.nbytes) != (r.dtype, r.shape, r.nbytes):
            what = (
                "shape" if s.shape != r.shape else "dtype" if s.dtype != r.dtype else "byte count"
            )
            return f"key {s.path!r} differs in {what}: the sender sends {s.words()}; this tensordict has {r.words()}"
    for s, r in zip(sender.leaves, receiver.leaves):
        if s.offset != r.offset:
            return (
                f"key {s.path!r} differs in its place in the consolidated storage: the sender's is at byte "
                f"{s.offset}, this tensordict's at byte {r.offset}"
            )
    if sender.storage != receiver.storage:
        return (
            f"the consolidated storage: the sender's holds {sender.storage} bytes, this tensordict's "
            f"{receiver.storage}"
        )
    return None
