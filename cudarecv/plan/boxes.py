"""Boxes: the part of a tensor one rank holds or needs, as a start and a size per dimension, and how DTensor's
placements cut a tensor into them (the chunks ``torch.chunk`` makes, uneven ones included).

Example:
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> shard_box((10, 4), (2, 2), (Shard(0), Shard(1)), (1, 0))
    Box(starts=(5, 0), sizes=(5, 2))
    >>> Box((0, 0), (10, 4)) & Box((5, 0), (5, 2)) == Box((5, 0), (5, 2))
    True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..core.errors import ArgumentError


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``size`` elements cut in ``parts`` as ``torch.chunk`` cuts
    (and DTensor's ``Shard``): chunks of ``ceil(size / parts)``, the last ones shorter or empty."""
    full = -(-size // parts) if parts else 0
    start = min(size, full * index)
    return start, max(0, min(size, start + full) - start)


@dataclass(frozen=True)
class Box:
    """Elements ``starts[d] .. starts[d] + sizes[d] - 1`` of every dimension ``d`` of a tensor."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def __and__(self, other: Box) -> Box | None:
        """The overlap of two boxes of one tensor, or None where they share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.starts, other.starts))
        ends = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.starts, self.sizes, other.starts, other.sizes)
        )
        sizes = tuple(e - s for s, e in zip(starts, ends))
        if any(n <= 0 for n in sizes):
            return None
        return Box(starts, sizes)

    def within(self, outer: Box) -> tuple[slice, ...]:
        """The index of this box in a tensor that holds ``outer`` (which contains it)."""
        return tuple(
            slice(s - o, s - o + n) for s, o, n in zip(self.starts, outer.starts, self.sizes)
        )

    def split(self, dim: int, parts: int, index: int) -> Box:
        """Chunk ``index`` of this box cut in ``parts`` along ``dim``."""
        start, length = chunk(self.sizes[dim], parts, index)
        return Box(
            self.starts[:dim] + (self.starts[dim] + start,) + self.starts[dim + 1 :],
            self.sizes[:dim] + (length,) + self.sizes[dim + 1 :],
        )

    def to_json(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.starts, self.sizes)]


def shard_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
    coordinate: Sequence[int],
    name: str = "a leaf",
) -> Box:
    """The box that the rank at ``coordinate`` of a mesh of ``mesh_shape`` holds of a tensor of ``shape`` placed
    by ``placements`` (``Shard(d)``: cut dimension ``d`` along that mesh dimension; ``Replicate()``: whole),
    applied in mesh-dimension order as DTensor applies them. Raises :class:`ArgumentError` naming ``name`` for a
    placement that is no plain shard or replica (``Partial`` sums, ``_StridedShard`` interleaves)."""
    from torch.distributed.tensor import Replicate, Shard

    box = Box.full(shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            box = box.split(
                placement.dim % max(len(shape), 1), mesh_shape[mesh_dim], coordinate[mesh_dim]
            )
        elif not isinstance(placement, Replicate):
            raise ArgumentError(
                f"{name} is placed {type(placement).__name__} ({placement}) on mesh dimension {mesh_dim}: weight sync sends "
                "Shard(d) and Replicate() leaves; redistribute it to one of those first"
            )
    return box


def coordinates(mesh_shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    """Every coordinate of a mesh, in the order of its ranks (row-major)."""
    return itertools.product(*(range(n) for n in mesh_shape))


def duty(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
    coordinate: Sequence[int],
    name: str = "a leaf",
) -> Box | None:
    """The box the rank at ``coordinate`` sends, so that every element is sent once: the ranks that hold one
    box (replicas) cut it between them along its first dimension (its largest, if the first has fewer elements
    than replicas); None where its share is empty."""
    mine = shard_box(shape, mesh_shape, placements, coordinate, name)
    replicas = [
        c
        for c in coordinates(mesh_shape)
        if shard_box(shape, mesh_shape, placements, c, name) == mine
    ]
    if not mine.sizes:  # a scalar: the first replica sends it
        return mine if replicas.index(tuple(coordinate)) == 0 else None
    dim = (
        0
        if mine.sizes[0] >= len(replicas)
        else max(range(len(mine.sizes)), key=lambda d: mine.sizes[d])
    )
    share = mine.split(dim, len(replicas), replicas.index(tuple(coordinate)))
    return share if share.numel else None
