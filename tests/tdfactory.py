"""Deterministic tensordicts of every supported structure, built the same way on each rank."""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, tensorclass


@tensorclass
class Batch:
    obs: torch.Tensor
    reward: torch.Tensor
    note: str


def make(structure: str, fill: float):
    """A tensordict of kind ``structure`` with every value derived from ``fill``.

    Keys are inserted out of sorted order on purpose: the wire order is sorted.
    """

    def v(*shape, dtype=torch.float32, salt=0.0):
        n = 1
        for s in shape:
            n *= s
        return (torch.arange(n, dtype=torch.float64) + fill * 1000 + salt).reshape(shape).to(dtype)

    if structure == "flat":
        return TensorDict(
            z=v(3), a=v(2, 2, salt=1), m=v(5, dtype=torch.int64, salt=2), batch_size=[]
        )
    if structure == "nested":
        return TensorDict(
            b=v(4, salt=1),
            a=TensorDict(
                y=v(2, 3, salt=2), x=TensorDict(q=v(1, dtype=torch.int32, salt=3)), batch_size=[]
            ),
            c=v(2, dtype=torch.float64, salt=4),
            flag=v(3, dtype=torch.bool),
            text=NonTensorData("hello"),
            batch_size=[],
        )
    if structure == "lazy":
        members = [TensorDict(b=v(3, salt=i), a=v(2, salt=10 + i)) for i in range(3)]
        return LazyStackedTensorDict(*members, stack_dim=0)
    if structure == "tensorclass":
        return Batch(obs=v(2, 4), reward=v(2, 1, salt=5), note="n", batch_size=[2])
    if structure == "nested_tensorclass":
        return TensorDict(
            tc=Batch(obs=v(2, 4), reward=v(2, 1, salt=5), note="n", batch_size=[2]),
            a=v(3, salt=6),
            batch_size=[],
        )
    if structure == "zero_size":  # empty leaves have no storage (data pointer 0) once consolidated
        return TensorDict(
            a=v(4),
            z=v(0, salt=1),
            e=v(2, 0, 3, salt=2),
            b=v(3, dtype=torch.int64, salt=3),
            batch_size=[],
        )
    raise ValueError(structure)


STRUCTURES = ("flat", "nested", "lazy", "tensorclass", "nested_tensorclass", "zero_size")


def leaves(td) -> list[torch.Tensor]:
    """All tensors of ``td`` in a canonical order, for comparisons."""
    from cudarecv.plan.walk import unwrap, walk

    return walk(unwrap(td))[1]


def same(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
