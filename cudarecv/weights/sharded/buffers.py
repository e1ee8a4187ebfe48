"""A sharded receiver's two buffers of the wanted layout (:class:`Buffers`): the published version and the one
every sender rank's pieces land in, in place where a piece is one block of the layout
(:meth:`Buffers.places`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from ...plan.boxes import Box
from ..schema import Schema
from ..slots import Slot, Slots
from .layout import Layout

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class Buffers:
    """Two buffers of ``wanted`` (a receiver's layout, in ``source``'s leaf order): their :class:`Slots`, and each
    one's leaves as plain local tensors (:attr:`views`); their tensordicts hold DTensors where ``dtensors``
    (leaf index -> the expected DTensor) says."""

    def __init__(
        self,
        wanted: Layout,
        source: Layout,
        dtensors: dict[int, DTensor],
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.parts, self._dtensors, self._device, self._pin = (
            wanted.parts,
            dtensors,
            device,
            pin_memory,
        )
        sizes = [
            p.box.sizes if p.box is not None else self._empty_shape(i, source)
            for i, p in enumerate(self.parts)
        ]
        self._schema = Schema.of(
            [p.key for p in self.parts],
            [torch.empty(s, dtype=p.dtype, device="meta") for s, p in zip(sizes, self.parts)],
        )
        self.views: list[list[torch.Tensor]] = []
        own = []
        for _ in range(2):
            slot, views = self._buffer()
            own.append(slot)
            self.views.append(views)
        self.slots = Slots(own, [], threading.Condition(), lambda version: None)

    def places(
        self, moved: list[tuple[int, Box]]
    ) -> list[dict[tuple[str, ...], torch.Tensor | None]]:
        """Where each of a sender rank's pieces (leaf index, box of the whole) lies in each buffer: its block, if
        one contiguous block (else None: staged, then copied)."""
        return [
            {
                self.parts[j].key: _contiguous(views[j][box.within(self.parts[j].known_box)])
                for j, box in moved
            }
            for views in self.views
        ]

    def retire(self, index: int) -> None:
        """A sender rank's receiver renewed its slot ``index``: a parked send may read its pieces in buffer
        ``index`` for good, so that buffer is never written again; a new one takes its place (the other ranks'
        pieces that still land in the old one are copied over, as strided pieces are)."""
        slot, views = self._buffer()
        self.slots.own[index], self.views[index] = slot, views

    def _buffer(self) -> tuple[Slot, list[torch.Tensor]]:
        schema = self._schema
        slot = Slot(schema, max(schema.total, 1), self._device, self._pin)
        views = schema.views(slot.storage)
        if self._dtensors:
            from torch.distributed.tensor import DTensor

            slot.td = TensorDict(
                {
                    p.key: DTensor.from_local(
                        v,
                        self._dtensors[i].device_mesh,
                        self._dtensors[i].placements,
                        run_check=False,
                        shape=self._dtensors[i].shape,
                        stride=self._dtensors[i].stride(),
                    )
                    if i in self._dtensors
                    else v
                    for i, (p, v) in enumerate(zip(self.parts, views))
                },
                batch_size=[],
            ).lock_()
        return slot, views

    def _empty_shape(self, index: int, source: Layout) -> tuple[int, ...]:
        """The local shape of a leaf this receiver holds nothing of (an empty shard of its mesh)."""
        if index in self._dtensors:
            return tuple(self._dtensors[index].to_local().shape)
        return tuple(source.parts[index].shape)


def _contiguous(view: torch.Tensor) -> torch.Tensor | None:
    """``view`` if its elements are one block, else None."""
    return view if view.is_contiguous() else None
