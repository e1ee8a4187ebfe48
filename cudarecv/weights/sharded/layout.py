"""What one rank of a sharded weight sync sends or wants of each leaf (:class:`Layout`), read from DTensor
leaves (or plain tensors), and the pieces a sender-receiver pair moves: the overlap of the box the sender sends
with the box the receiver wants, leaf by leaf (:func:`pieces`), computed the same way on both ends.

A layout travels as JSON, parsed and checked field by field like the schema (:mod:`cudarecv.weights.schema`).

Example:
    >>> source = sender_layout(keys, tensors)        # on a trainer rank: DTensor leaves of an FSDP2 model
    >>> wanted = receiver_layout(keys, expected)     # on a receiver: full tensors, or DTensors of its own mesh
    >>> moved = pieces(source, wanted)               # [(leaf index, Box), ...]: what this pair moves
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from torch import Tensor

from ...core.errors import ArgumentError, ArgumentTypeError, SchemaError
from ...plan.boxes import Box, duty, shard_box
from ..schema import DTYPES, check_size, on_wire

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

FORMAT = "cudarecv-sharded"


def dtensor_type() -> type[DTensor]:
    """DTensor's class, imported when first needed (torch.distributed.tensor is slow to import)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (the sharded weight sync's case)."""
    if not tensors:
        return False
    DTensor = dtensor_type()
    return any(isinstance(t, DTensor) for t in tensors)


@dataclass(frozen=True)
class Part:
    """A leaf as one rank has it: its key, dtype and whole shape, and the box it sends or wants (None: none)."""

    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    box: Box | None

    @property
    def name(self) -> str:
        return ".".join(self.key)

    @property
    def known_box(self) -> Box:
        """``box``, of a leaf known to have one (every leaf of a pair's :func:`pieces` has)."""
        if self.box is None:
            raise AssertionError(f"leaf {self.name!r} has no box here")  # a bug: pieces() skips it
        return self.box


@dataclass(frozen=True)
class Layout:
    """Every leaf of one rank, in the sender's order."""

    parts: tuple[Part, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "version": 1,
                "leaves": [
                    {
                        "key": list(p.key),
                        "dtype": str(p.dtype).removeprefix("torch."),
                        "shape": list(p.shape),
                        "box": None if p.box is None else p.box.to_json(),
                    }
                    for p in self.parts
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Layout:
        """Parse and check a received layout: strict types, unique keys, known dtypes, sizes in range and every
        box inside its leaf. Raises :class:`SchemaError` on anything off."""
        try:
            doc = json.loads(raw.decode())
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
                raise SchemaError("not a cudarecv sharded layout")
            if not isinstance(doc["leaves"], list) or not doc["leaves"]:
                raise SchemaError("a sharded layout with no leaves")
            parts: list[Part] = []
            seen: set[tuple[str, ...]] = set()
            for item in doc["leaves"]:
                parts.append(_part(item, seen))
        except SchemaError:
            raise
        except Exception as error:  # noqa: BLE001 - json and the fields' checks raise many kinds
            raise SchemaError(
                f"malformed sharded layout: {type(error).__name__}: {error}"[:200]
            ) from None
        return cls(tuple(parts))

    def difference(self, other: Layout) -> str | None:
        """How ``other``'s leaves (keys, dtypes, whole shapes) differ from these, naming the first key."""
        mine = {p.key: (p.dtype, p.shape) for p in self.parts}
        theirs = {p.key: (p.dtype, p.shape) for p in other.parts}
        for key in sorted(set(mine) | set(theirs)):
            name = ".".join(key)
            if key not in theirs:
                return f"key {name!r} is sent but not expected"
            if key not in mine:
                return f"key {name!r} is expected but the sender does not send it"
            if mine[key] != theirs[key]:
                (d1, s1), (d2, s2) = mine[key], theirs[key]
                return f"key {name!r}: the sender sends {d1} {list(s1)} (whole), expected {d2} {list(s2)}"
        return None


def _part(item: Any, seen: set[tuple[str, ...]]) -> Part:
    key, dtype, shape, box = item["key"], item["dtype"], item["shape"], item["box"]
    if not (isinstance(key, list) and key and all(isinstance(k, str) and k for k in key)):
        raise SchemaError(f"bad key {key!r}: a list of non-empty strings")
    name = ".".join(key)
    if tuple(key) in seen:
        raise SchemaError(f"key {name!r} appears twice")
    seen.add(tuple(key))
    if dtype not in DTYPES:
        raise SchemaError(f"unknown dtype {dtype!r} for {name!r}")
    if not isinstance(shape, list) or len(shape) > 64:
        raise SchemaError(f"bad shape {shape!r} for {name!r}")
    shape = tuple(check_size(n, f"a dimension of {name!r}") for n in shape)
    if box is not None:
        if not (
            isinstance(box, list)
            and len(box) == len(shape)
            and all(isinstance(d, list) and len(d) == 2 for d in box)
        ):
            raise SchemaError(f"bad box {box!r} for {name!r} of shape {list(shape)}")
        starts = tuple(check_size(s, f"a box start of {name!r}") for s, _ in box)
        sizes = tuple(check_size(n, f"a box size of {name!r}") for _, n in box)
        if any(s + n > whole for s, n, whole in zip(starts, sizes, shape)) or any(
            n == 0 for n in sizes
        ):
            raise SchemaError(
                f"the box {box} of {name!r} is empty or reaches past its shape {list(shape)}"
            )
        box = Box(starts, sizes)
    return Part(tuple(key), DTYPES[dtype], shape, box)


def _checked_dtype(key: tuple[str, ...], tensor: Tensor) -> torch.dtype:
    if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
        raise SchemaError(
            f"leaf {'.'.join(key)!r} has dtype {tensor.dtype}, which weight sync does not carry"
        )
    return tensor.dtype


def held(tensor: Tensor, name: str) -> tuple[Tensor, Box]:
    """The local tensor of a leaf and the box of the whole it holds (a plain tensor: the whole)."""
    if not isinstance(tensor, dtensor_type()):
        return tensor, Box.full(tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ArgumentError(
            f"leaf {name!r} is a DTensor on a mesh of ranks {mesh.mesh.flatten().tolist()}, "
            "which this rank is not part of"
        )
    box = shard_box(tensor.shape, mesh.shape, tensor.placements, coordinate, f"leaf {name!r}")
    local = tensor.to_local()
    if tuple(local.shape) != box.sizes:
        raise ArgumentError(
            f"leaf {name!r}: its local tensor is {list(local.shape)}, where its placements "
            f"{tensor.placements} give {list(box.sizes)}: a padded or strided shard"
        )
    return local, box


def on_wire_layout(layout: Layout, wire_dtype: torch.dtype | None) -> Layout:
    """``layout`` with its floating-point leaves in ``wire_dtype`` (a sender's; see
    :func:`~cudarecv.weights.schema.on_wire`): what its receivers hold."""
    if wire_dtype is None:
        return layout
    return Layout(
        tuple(dataclasses.replace(p, dtype=on_wire(p.dtype, wire_dtype)) for p in layout.parts)
    )


def sender_layout(keys: Sequence[tuple[str, ...]], tensors: Sequence[Tensor]) -> Layout:
    """The layout a sender rank sends: each DTensor leaf's share (:func:`~cudarecv.plan.boxes.duty`: replicas
    split it, so every element is sent by one rank), and each plain leaf as replicated over the mesh of the
    DTensor leaves; with no DTensor leaf (a ``ShardedSender`` of plain tensors), every leaf whole from this one rank. Raises
    :class:`ArgumentError` if the DTensor leaves are on meshes of different ranks."""
    DTensor = dtensor_type()
    meshes = {
        tuple(t.device_mesh.mesh.flatten().tolist()): t.device_mesh
        for t in tensors
        if isinstance(t, DTensor)
    }
    if not meshes:  # plain tensors (a ``ShardedSender`` of them): one rank sends every leaf whole
        return Layout(
            tuple(
                Part(
                    tuple(map(str, k)),
                    _checked_dtype(k, t),
                    tuple(t.shape),
                    Box.full(t.shape) if t.numel() else None,
                )
                for k, t in zip(keys, tensors)
            )
        )
    if len(meshes) != 1:
        raise ArgumentError(
            f"the DTensor leaves of `td` lie on meshes of different ranks {sorted(meshes)}: a sharded "
            "WeightSender sends from one mesh (every rank of it builds one)"
        )
    mesh = next(iter(meshes.values()))
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ArgumentError(
            f"this rank is not part of the mesh of `td`'s DTensor leaves ({sorted(meshes)[0]}): "
            "a sharded WeightSender is built on the ranks of that mesh"
        )
    parts = []
    for key, t in zip(keys, tensors):
        key, name = tuple(map(str, key)), ".".join(map(str, key))
        if isinstance(t, DTensor):
            box = duty(t.shape, mesh.shape, t.placements, coordinate, f"leaf {name!r}")
        else:
            from torch.distributed.tensor import Replicate

            box = duty(t.shape, mesh.shape, [Replicate()] * mesh.ndim, coordinate, f"leaf {name!r}")
        parts.append(Part(key, _checked_dtype(key, t), tuple(t.shape), box))
    return Layout(tuple(parts))


def receiver_layout(keys: Sequence[tuple[str, ...]], tensors: Sequence[Tensor]) -> Layout:
    """The layout a receiver wants: the whole of each plain leaf, the local box of each DTensor leaf."""
    parts = []
    for key, t in zip(keys, tensors):
        key = tuple(map(str, key))
        _, box = held(t, ".".join(key))
        parts.append(Part(key, _checked_dtype(key, t), tuple(t.shape), box if box.numel else None))
    return Layout(tuple(parts))


#: how ``want`` is written, for the messages that refuse it
WANT_FORM = (
    "`want` maps leaf names to slices of the whole leaf, one per leading dimension, step 1, with int bounds "
    'from 0 to its size, e.g. {"up.weight": (slice(0, 512),), "down.weight": (slice(None), slice(0, 512))}'
)


def check_want(want: Any) -> dict[str, tuple[slice, ...]]:
    """``want`` checked for its form alone, before anything is sent (the leaves' shapes come later, with the
    layouts: :func:`narrowed`): a mapping of leaf names (``"a.b"`` for key ``("a", "b")``) to a slice or a tuple
    (or list) of slices, each of step 1 (or None) with bounds that are ints (or None) and not negative; returned
    as name -> tuple of slices with int bounds. Raises :class:`ArgumentTypeError` for a wrong type (a list of
    pairs, a name not a string, an index not a slice, a bound of 2.5 or True) and :class:`ArgumentError` for a
    wrong value (a step, a negative bound), each naming the entry of ``want`` and the fix."""
    if not isinstance(want, Mapping):
        raise ArgumentTypeError(f"`want` must be a dict, got {type(want).__name__}: {WANT_FORM}")
    checked = {}
    for name, index in want.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(
                f"`want` names leaf {name!r} ({type(name).__name__}): name each leaf by its "
                f'key joined with dots, as a string ("a.b" for key ("a", "b")); {WANT_FORM}'
            )
        slices = tuple(index) if isinstance(index, (tuple, list)) else (index,)
        checked[name] = tuple(_checked_slice(name, s) for s in slices)
    return checked


def _checked_slice(name: str, index: Any) -> slice:
    """One slice of ``want[name]``, its bounds as ints (see :func:`check_want`)."""
    entry = f"`want[{name!r}]`"
    if not isinstance(index, slice):
        hint = (
            f" (index {index} alone is slice({index}, {index + 1}))"
            if isinstance(index, int) and not isinstance(index, bool)
            else ""
        )
        raise ArgumentTypeError(
            f"{entry} holds {index!r} ({type(index).__name__}), not a slice{hint}; {WANT_FORM}"
        )
    if index.step is not None and (isinstance(index.step, bool) or not isinstance(index.step, int)):
        raise ArgumentTypeError(
            f"{entry} = {index!r} has the step {index.step!r} ({type(index.step).__name__}): "
            f"leave the step out (or 1); {WANT_FORM}"
        )
    if index.step not in (None, 1):
        raise ArgumentError(
            f"{entry} = {index!r} has step {index.step!r}: only step-1 slices (a block of the leaf) "
            f"travel; take every element of the range and drop what you do not need; {WANT_FORM}"
        )
    bounds: list[int | None] = []
    for bound in (index.start, index.stop):
        if bound is None:
            bounds.append(None)
            continue
        try:
            if isinstance(bound, bool):
                raise TypeError
            bound = operator.index(bound)  # (an int, or an integer type such as numpy's)
        except TypeError:
            raise ArgumentTypeError(
                f"{entry} = {index!r} has the bound {bound!r} ({type(bound).__name__}): bounds "
                f"are ints or None; {WANT_FORM}"
            ) from None
        if bound < 0:
            raise ArgumentError(
                f"{entry} = {index!r} has the negative bound {bound}: count from the start of the "
                f"dimension (size - {-bound} for {bound}); {WANT_FORM}"
            )
        bounds.append(bound)
    return slice(bounds[0], bounds[1])


def narrowed(layout: Layout, want: Mapping[str, Sequence[slice]], dtensors: set[int]) -> Layout:
    """``layout`` (a receiver's) with each leaf ``want`` names (``"a.b"`` for key ``("a", "b")``) cut to the
    slices given, of the whole leaf: what a receiver wants that no DTensor layout says (e.g. a vLLM worker's part
    of each checkpoint tensor). ``want`` is checked as :func:`check_want` does, then against the leaves: raises
    :class:`ArgumentError` naming a key it does not have, a leaf ``expect`` gives as a DTensor (leaf indices
    ``dtensors``), more slices than the leaf has dimensions, a bound past the leaf's size, or an empty range."""
    want = check_want(want)
    by_name = {p.name: i for i, p in enumerate(layout.parts)}
    parts = list(layout.parts)
    for name, index in want.items():
        if name not in by_name:
            raise ArgumentError(
                f"`want` names {name!r}, which the sender does not send (leaves: "
                f"{sorted(by_name)[:5]}...)"
            )
        i = by_name[name]
        if i in dtensors:
            raise ArgumentError(
                f"`want` names {name!r}, which `expect` gives as a DTensor: its placements say "
                "what this receiver wants; drop one of the two"
            )
        shape = parts[i].shape
        if len(index) > len(shape):
            raise ArgumentError(
                f"`want[{name!r}]` = {index!r} has {len(index)} slices, but the leaf has "
                f"{len(shape)} dimension(s) {list(shape)}: give up to {len(shape)} step-1 slices"
            )
        for dim, (s, n) in enumerate(zip(index, shape)):
            if max(s.start or 0, n if s.stop is None else s.stop) > n:
                raise ArgumentError(
                    f"`want[{name!r}]` = {index!r} reaches past dimension {dim} of the leaf, of size "
                    f"{n} (shape {list(shape)}): bounds run from 0 to {n}"
                )
        ranges = [s.indices(n)[:2] for s, n in zip(index, shape)] + [
            (0, n) for n in shape[len(index) :]
        ]
        if any(stop <= start for start, stop in ranges):
            raise ArgumentError(
                f"`want[{name!r}]` = {index!r} is empty for its {list(shape)} elements: want "
                "some of every leaf, or leave the leaf out of `want` to take it whole"
            )
        parts[i] = Part(
            parts[i].key,
            parts[i].dtype,
            shape,
            Box(tuple(a for a, _ in ranges), tuple(b - a for a, b in ranges)),
        )
    return Layout(tuple(parts))


def wanting_all(source: Layout) -> Layout:
    """A receiver's layout without ``expect``: every leaf whole."""
    return Layout(
        tuple(
            Part(
                p.key, p.dtype, p.shape, Box.full(p.shape) if torch.Size(p.shape).numel() else None
            )
            for p in source.parts
        )
    )


def in_order(wanted: Layout, source: Layout) -> Layout:
    """``wanted``'s parts in ``source``'s leaf order (the keys are the same: checked first)."""
    by_key = {p.key: p for p in wanted.parts}
    return Layout(tuple(by_key[p.key] for p in source.parts))


def pieces(source: Layout, wanted: Layout) -> list[tuple[int, Box]]:
    """What a pair moves: for each leaf (by index) the overlap of the box sent and the box wanted, if any.
    ``wanted`` is in ``source``'s order (:func:`in_order`)."""
    moved = []
    for index, (sent, want) in enumerate(zip(source.parts, wanted.parts)):
        if sent.box is not None and want.box is not None:
            overlap = sent.box & want.box
            if overlap is not None:
                moved.append((index, overlap))
    return moved


def uncovered(wanted: Layout, moved: dict[int, list[tuple[int, Box]]]) -> str | None:
    """Whether the pieces from every source (by rank) fill each wanted box exactly once; else what is off,
    naming the leaf (elements no source sends, or sent twice)."""
    for index, part in enumerate(wanted.parts):
        if part.box is None:
            continue
        boxes = [(rank, box) for rank, found in moved.items() for i, box in found if i == index]
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                twice = boxes[a][1] & boxes[b][1]
                if twice is not None:
                    return (
                        f"leaf {part.name!r}: ranks {boxes[a][0]} and {boxes[b][0]} both send elements "
                        f"{twice.to_json()}: are they on one mesh, as one sender?"
                    )
        if sum(box.numel for _, box in boxes) != part.box.numel:
            got = sum(box.numel for _, box in boxes)
            return (
                f"leaf {part.name!r}: the sources {sorted(moved)} send {got} of the {part.box.numel} elements "
                "wanted here: pass every rank of the sender's mesh as `src`"
            )
    return None


def piece_views(
    parts: Sequence[Part],
    moved: list[tuple[int, Box]],
    tensors: Sequence[Tensor],
    boxes: Sequence[Box],
) -> TensorDict:
    """The pieces ``moved`` as views of ``tensors`` (leaf ``i`` holding ``boxes[i]`` of the whole), keyed like
    their leaves: what a pair's weight sender sends, or its receiver's buffers are shaped as."""
    return TensorDict(
        {parts[i].key: tensors[i][box.within(boxes[i])] for i, box in moved}, batch_size=[]
    )
