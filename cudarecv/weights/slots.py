"""A weight receiver's storages: two of its own (the published version, and the one the next pull lands in; for
a sharded receiver's inner ones, whose leaves lie in its buffers, the one it says), and with zero-copy the
sender's shared snapshots, published where they lie. Readers hold the published one
(:meth:`Slots.reading`) against the next pull; a zero-copy snapshot is let go of (the sender told ``FREED``)
once a newer version is published and no reader is left on it."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from torch import Tensor

from ..core.errors import SchemaError, UsageError, WaitTimeout
from ..core.host_copy import copy_bytes
from .schema import Schema, aligned
from .wire import checksum, checksum_pending

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    from ..cuda.digest import Pending


class Slot:
    """One storage the receiver can publish, with its tensordict of views and readers: its own, or (``storage``
    given, zero-copy) the sender's shared snapshot, mapped read-only. :meth:`placed_at` builds one whose leaves lie
    where the caller says (a sharded receiver's pieces, landed in place)."""

    def __init__(
        self,
        schema: Schema,
        bucket_bytes: int,
        device: torch.device,
        pin_memory: bool,
        storage: Tensor | None = None,
        leaves: list[Tensor] | None = None,
    ) -> None:
        self.alias = storage is not None and leaves is None
        if storage is None:
            storage = torch.zeros(
                schema.total, dtype=torch.uint8, device=device, pin_memory=pin_memory
            )
        self.storage = storage
        self.version: int | None = (
            None  # an alias: the version it holds, until the sender is told it is FREED
        )
        self.placed = leaves is not None
        views = leaves if leaves is not None else schema.views(self.storage)
        self.td = TensorDict(
            {leaf.key: v for leaf, v in zip(schema.leaves, views)}, batch_size=[]
        ).lock_()
        if len(self.td.keys(True, True)) != len(schema.leaves):
            raise SchemaError("the schema's keys do not make one leaf each")
        #: the messages a version lands in, in order
        self.pieces = (
            schema.cut_leaves([_bytes(v) for v in views], bucket_bytes)
            if self.placed
            else schema.cut(self.storage, bucket_bytes)
        )
        self._whole = (
            None if schema.leafwise else self.storage
        )  # the digest's input at once, if one storage
        self._messages = schema.messages(bucket_bytes) if self.placed else []
        self._schema, self._bucket_bytes = schema, bucket_bytes
        self.readers = 0

    @classmethod
    def placed_at(
        cls,
        schema: Schema,
        bucket_bytes: int,
        device: torch.device,
        pin_memory: bool,
        places: list[Tensor | None],
    ) -> Slot:
        """A slot of a leafwise ``schema`` whose leaf i lies at ``places[i]`` (a contiguous tensor of its dtype and
        shape, written in place by each pull), or, where that is None, in a storage of the slot's own."""
        if not schema.leafwise:
            raise UsageError("only a leafwise schema's messages can land where their leaves lie")
        sizes = [
            aligned(leaf.nbytes) for leaf, place in zip(schema.leaves, places) if place is None
        ]
        storage = torch.zeros(sum(sizes), dtype=torch.uint8, device=device, pin_memory=pin_memory)
        own = iter(storage.split(sizes) if sizes else [])
        leaves = []
        for leaf, place in zip(schema.leaves, places):
            if place is None:
                place = next(own)[: leaf.nbytes].view(leaf.dtype).view(leaf.shape)
            elif (place.dtype, tuple(place.shape)) != (
                leaf.dtype,
                leaf.shape,
            ) or not place.is_contiguous():
                raise UsageError(
                    f"leaf {leaf.name!r} cannot land in a {place.dtype} {list(place.shape)} "
                    f"{'' if place.is_contiguous() else 'strided '}tensor"
                )
            leaves.append(place)
        return cls(schema, bucket_bytes, device, pin_memory, storage, leaves)

    def writable(self) -> Slot:
        """This slot, or, placed (its leaves lie in its owner's buffers, which only the owner's pulls may write),
        one like it in storage of its own: where a closing receiver lands what it forwards."""
        return (
            Slot(self._schema, self._bucket_bytes, self.storage.device, self.storage.is_pinned())
            if self.placed
            else self
        )

    def digest(self) -> bytes:
        """BLAKE3 of what landed: the messages in order (``verify``)."""
        return checksum(self.pieces, self._whole)

    def digest_pending(self) -> Pending:
        """:meth:`digest`, started on the current stream (yield its ``work``, then read its ``value()``)."""
        return checksum_pending(self.pieces, self._whole)

    def fill(self, source: Tensor) -> None:
        """Copy a version laid out as the schema (``source``: uint8, a sender's snapshot) into this slot (on the
        current stream for device memory)."""
        if not self.placed:
            if source.device.type == self.storage.device.type == "cpu":
                copy_bytes(self.storage, source[: self.storage.numel()])
            else:
                self.storage.copy_(source[: self.storage.numel()], non_blocking=True)
            return
        for (start, size), message in zip(
            self._messages, self.pieces
        ):  # each message where its leaf lies
            message.copy_(source[start : start + size], non_blocking=True)

    def copy_to(self, storage: Tensor) -> None:
        """Copy the version this slot holds into ``storage`` (uint8, laid out as the schema: a placed slot's leaves
        to their offsets, the padding between them left as it is)."""
        if not self.placed:
            storage.copy_(self.storage, non_blocking=True)
            return
        for (start, size), message in zip(self._messages, self.pieces):
            storage[start : start + size].copy_(message, non_blocking=True)


def _bytes(tensor: Tensor) -> Tensor:
    """A contiguous tensor's bytes, as a 1-d uint8 view."""
    return (
        tensor.reshape(-1).view(torch.uint8)
        if tensor.numel()
        else torch.empty(0, dtype=torch.uint8, device=tensor.device)
    )


class Slots:
    """The receiver's two own slots and its zero-copy aliases (one per shared snapshot), which is published, and
    who reads it; ``freed(version)`` tells the sender an alias's snapshot may be written again."""

    def __init__(
        self,
        own: list[Slot],
        aliases: list[Slot],
        cond: threading.Condition,
        freed: Callable[[int], None],
    ) -> None:
        self.own, self.aliases, self.cond, self._freed = own, aliases, cond, freed
        self.published: Slot | None = None
        self._spare: Callable[[], int] | None = None
        self._retire: Callable[[int], None] | None = None

    def place(self, spare: Callable[[], int], retire: Callable[[int], None]) -> None:
        """The own slots are placed in an owner's two buffers: ``spare()`` says which one the next pull lands in
        (never the one the owner published), and ``retire(i)`` replaces buffer ``i`` once own slot ``i`` is
        renewed (a parked send may read it for good)."""
        self._spare, self._retire = spare, retire

    @property
    def count(self) -> int:
        return len(self.own) + len(self.aliases)

    def td(self) -> TensorDict:
        if self.published is None:
            raise UsageError("no version has landed yet: call pull() first")
        return self.published.td

    @contextlib.contextmanager
    def reading(self) -> Iterator[TensorDict]:
        """Hold the published version while reading it: no pull writes into it meanwhile."""
        with self.cond:
            if self.published is None:
                raise UsageError("no version has landed yet: call pull() first")
            slot = self.published
            slot.readers += 1
        try:
            yield slot.td
        finally:
            with self.cond:
                slot.readers -= 1
                if slot.alias and slot.readers == 0 and slot is not self.published:
                    self._free(slot)
                self.cond.notify_all()

    def spare(self) -> int:
        """The index of the own slot the next pull lands in (not the published one, unless a placed slot's owner
        says otherwise: the slots then lie in its buffers, and it never has the next pull land in its published one)."""
        if self._spare is not None:
            return self._spare()
        return 1 if self.published is self.own[0] else 0

    def wait_unread(self, index: int, timeout: float) -> Slot:
        """Own slot ``index`` once no reader holds it (waiting up to ``timeout`` s)."""
        slot = self.own[index]
        with self.cond:
            if not self.cond.wait_for(lambda: slot.readers == 0, timeout=timeout):
                raise WaitTimeout(f"a reader held the spare weights buffer for {timeout:g} s")
        return slot

    def renew(self, index: int, schema: Schema, bucket_bytes: int, device: torch.device) -> None:
        """Own slot ``index`` may be read by a parked send for good: never write it again (a placed one: nor its
        owner's buffer, which the owner replaces)."""
        old = self.own[index]
        self.own[index] = Slot(schema, bucket_bytes, device, old.storage.is_pinned())
        if old.placed and self._retire is not None:
            self._retire(index)

    def publish(self, slot: Slot, version: int, tell: bool = True) -> int:
        """Make ``slot`` the published version; a zero-copy snapshot published before is let go of (the sender
        may write it again) unless a reader still holds it (then once the last one leaves). Returns the version
        of the snapshot let go of now (0: none); ``tell=False``: the caller tells the sender (with its word on
        the new version), else it is told here."""
        with self.cond:
            previous, self.published = self.published, slot
            slot.version = version
            freed = 0
            if (
                previous is not None
                and previous is not slot
                and previous.alias
                and previous.readers == 0
            ):
                freed = self._free(previous, tell)
            self.cond.notify_all()
        return freed

    def _free(self, alias: Slot, tell: bool = True) -> int:
        """Under the lock: this receiver no longer reads ``alias`` (its snapshot); tell the sender (``tell``), and
        return its version (0: it held none)."""
        version, alias.version = alias.version, None
        if version is not None and tell:
            self._freed(version)
        return version or 0

    def keep_own_copy(self, busy: bool) -> None:
        """Zero-copy, on close: copy the published version out of the sender's snapshot into an own slot and let
        go of the snapshot (unless a reader holds it, or a pull is ``busy``: the sender then never writes it
        again)."""
        with self.cond:
            alias = self.published
            if alias is None or not alias.alias or alias.readers or busy:
                return
            own = self.own[0]
            if (
                own.placed
            ):  # its leaves lie in the owner's buffers (which copied what they need): let go only
                self.published = None
                self._free(alias)
                return
            if own.readers:
                return
            own.fill(alias.storage)
            version = alias.version
        assert version is not None  # (a published slot holds its version: publish() set it)
        self.publish(own, version)


def load_into(td: TensorDict, module: torch.nn.Module, strict: bool) -> None:
    """Copy ``td``'s leaves into ``module``'s parameters and buffers of the same names, in place; every name
    is matched and checked before anything is written (``strict=False``: names missing on either side are
    skipped)."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    pairs, missing = [], []
    for name, tensor in named:
        source = td.get(tuple(name.split(".")), None)
        if source is None:
            missing.append(name)
            continue
        if source.shape != tensor.shape or source.dtype != tensor.dtype:
            raise SchemaError(
                f"{name!r}: received {source.dtype} {list(source.shape)}, "
                f"module has {tensor.dtype} {list(tensor.shape)}"
            )
        if _placed(source) != _placed(
            tensor
        ):  # a DTensor: its local shard, never a collective copy
            raise SchemaError(
                f"{name!r}: received {_placed(source) or 'a whole tensor'}, the module holds "
                f"{_placed(tensor) or 'a whole tensor'}"
            )
        pairs.append((_local(tensor), _local(source)))
    extra = len(td.keys(True, True)) - len(pairs)
    if strict and (missing or extra):
        raise SchemaError(
            f"load_into: module names not received: {missing}; "
            f"{extra} received leaves not in the module (pass strict=False to skip)"
        )
    with torch.no_grad():
        for tensor, source in pairs:
            tensor.copy_(source, non_blocking=True)
    if any(s.device.type == "cpu" and t.device.type == "cuda" for t, s in pairs):
        # a copy out of host memory may still be queued: finish it before the next pull may write into it
        torch.cuda.current_stream(
            next(t for t, _ in pairs if t.device.type == "cuda").device
        ).synchronize()


def _placed(tensor: Tensor) -> tuple[tuple[int, ...], tuple[Placement, ...]] | None:
    """A DTensor's mesh ranks and placements (None for a plain tensor)."""
    dtensor = _dtensor(tensor)
    if dtensor is None:
        return None
    return tuple(dtensor.device_mesh.mesh.flatten().tolist()), tuple(dtensor.placements)


def _local(tensor: Tensor) -> Tensor:
    dtensor = _dtensor(tensor)
    return tensor if dtensor is None else dtensor.to_local()


def _dtensor(tensor: Tensor) -> DTensor | None:
    """``tensor`` as a DTensor, or None for a plain tensor. No DTensor exists before torch.distributed.tensor is
    imported, and importing it takes a second: a receiver of plain tensors never does."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return tensor if isinstance(tensor, DTensor) else None
