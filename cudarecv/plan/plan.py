"""Per-tensordict plans: everything about a transfer that does not depend on the data.

A :class:`Plan` holds the leaf walk, the byte views, the tags, the checks and
the fast wire's staging buffer and fingerprints of one tensordict. It is
cached per tensordict object and reused while the tensordict still holds the
same leaf tensors, each with the data pointer (which moves with the storage
offset) and contiguity it had; where the plan's byte layout is used (the fast
wire, staging through another device's memory) their dtype and shape are checked
too (``layout=True``). Any change of structure or of a leaf, in place included
(``resize_``, ``t_``, ``set_``, ``.data = x.view(dtype)``), builds a new plan, so
what a call uses of its plan is never stale; the stock wire posts the leaves
themselves, as they are. What per-call arguments key (pseudo-random
tags per ``init_tag``, layouts per piece size) is kept in bounded caches.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

from ..core import streams
from ..core.errors import ArgumentError
from ..core.host_copy import CopyTable
from ..core.lru import lru_get
from ..core.transfer import Transfer
from . import header
from .describe import describe
from .tags import tag_sequence
from .walk import Path, Skeleton, format_path, walk


class Plan:
    """The cached, data-independent part of transfers of one tensordict."""

    def __init__(self, paths: list[Path], tensors: list[Tensor]) -> None:
        self.paths = paths
        self.tensors = tensors
        self.signature = _signature(tensors)
        #: torch's C++ check of the leaves' sizes, strides and dtypes (:func:`_layout_guard`): None until a call
        #: checks the layout, False where this torch lacks it or it once saw a change that did not matter here
        self._guard: _Guard | Literal[False] | None = None
        self.nbytes = [t.numel() * t.element_size() for t in tensors]
        self.total = sum(self.nbytes)
        self._tags: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self._checked = False
        self._pieces: OrderedDict[tuple[int, str], _Layout] = OrderedDict()
        self._staging: dict[str, Tensor] = {}
        self._parts: dict[str, list[Tensor]] = {}
        self._storage: Tensor | None = None  # the consolidated storage last checked (storage())
        self._adopted: dict[str, Tensor] = {}  # places whose staging is a buffer given to the plan
        self.pool = (
            streams.StagingPool()
        )  # staging rings and their fences, for this tensordict alone
        self.in_flight: Transfer | None = (
            None  # the transfer still using the staging buffers, if any
        )
        #: held by a call from its look at :attr:`in_flight` until its own transfer is started and marked there
        #: (two threads calling with one tensordict at once take turns: :mod:`cudarecv.p2p.calls`)
        self.claim = threading.Lock()
        self.skeleton: Skeleton | None = (
            None  # an unlocked tensordict's dicts as last walked (see plan_for)
        )

    def matches(self, paths: list[Path], tensors: list[Tensor], layout: bool) -> bool:
        return (
            len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
            and paths == self.paths
            and self.unchanged(layout)
        )

    def unchanged(self, layout: bool) -> bool:
        """Whether the leaves still have :attr:`signature` (see :func:`_unchanged`). With ``layout``, torch's C++
        check of sizes, strides and dtypes answers first where it can (0.05 us a leaf instead of 0.3 us, the
        most of a fast-wire call's fixed cost at 2000 leaves); a change it sees that the signature does not
        hold (``requires_grad`` turned on, a call in inference mode) leaves this plan to the Python comparison."""
        guard = self._guard
        if layout and guard:
            try:
                if list(map(Tensor.data_ptr, self.tensors)) != self.signature[0]:
                    return False
            except RuntimeError:
                pass  # a leaf without data pointer: the Python comparison below says how
            else:
                if guard.check(*self.tensors):
                    return True
        same = _unchanged(self.tensors, self.signature, layout)
        if same and layout:
            if guard is None:
                # the leaves were just compared equal to the signature; the guard is kept only if they still
                # are once it is made (another thread may change a leaf meanwhile, and the guard holds the
                # leaves as they are when made)
                made = _layout_guard(self.tensors)
                if made and _unchanged(self.tensors, self.signature, layout):
                    self._guard = made
                elif not made:
                    self._guard = False
            else:
                self._guard = False  # it sees what does not matter here: no use asking it again
        return same

    def tags(self, init_tag: int, count: int, pseudo_rand: bool) -> Sequence[int]:
        """``count`` tags from ``init_tag`` as stock tensordict draws them.

        Consecutive tags are a ``range`` (nothing stored); pseudo-random ones are
        kept for the last :data:`CACHED` ``(init_tag, count)`` pairs.
        """
        if not pseudo_rand:
            return range(init_tag, init_tag + count)
        return lru_get(
            self._tags,
            (init_tag, count),
            lambda: tag_sequence(init_tag, count, pseudo_rand=True).tolist(),
            CACHED,
        )

    def check(self, strided: bool = False) -> None:
        """Raise if a leaf cannot travel (once per plan). ``strided``: a leaf need not be contiguous (what is sent
        is a copy of it, as a weight sender's snapshot)."""
        if self._checked:
            return
        for path, t in zip(self.paths, self.tensors):
            problem = _leaf_problem(t, strided)
            if problem:
                raise ArgumentError(f"leaf {format_path(path)!r} cannot travel: {problem}")
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            first: dict[torch.device, str] = {}
            for path, t in zip(self.paths, self.tensors):
                first.setdefault(t.device, format_path(path))
            raise ArgumentError(
                "the leaves are on several devices ("
                + ", ".join(f"{k!r} on {d}" for d, k in first.items())
                + "): one transfer moves one device's memory; call `td = td.to(device)` once"
            )
        self._checked = not strided

    @cached_property
    def device(self) -> torch.device:
        """The device of the leaves (the CPU for a tensordict without leaves)."""
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @cached_property
    def detached(self) -> list[Tensor]:
        """The leaves as tensors that never join an autograd graph (same memory)."""
        return [t.detach() for t in self.tensors]

    @cached_property
    def byte_views(self) -> list[Tensor]:
        """Each leaf as a flat uint8 view (leaves are contiguous, see :meth:`check`)."""
        return [t.reshape(-1).view(torch.uint8) for t in self.tensors]

    def staging(self, place: str) -> Tensor:
        """One reused buffer holding the leaves back to back, in send order.

        ``place``: ``"cpu"``, ``"pinned"`` (page-locked, for gloo with CUDA leaves)
        or a CUDA device (for NCCL); allocated once per plan and place.
        """
        buffer = self._staging.get(place)
        if buffer is None:
            if place == "pinned":
                buffer = torch.empty(self.total, dtype=torch.uint8, pin_memory=True)
            else:
                buffer = torch.empty(self.total, dtype=torch.uint8, device=place)
            self._staging[place] = buffer
        return buffer

    def adopt(self, place: str, buffer: Tensor) -> None:
        """Use ``buffer`` (at least :attr:`total` bytes, e.g. a shared segment) as the staging of ``place``."""
        if self._adopted.get(place) is not buffer:
            self._adopted[place] = buffer
            self._staging[place] = buffer[: self.total]
            self._parts.pop(place, None)
            for key in [k for k in self._pieces if k[1] == place]:
                del self._pieces[key]

    def staging_parts(self, place: str) -> list[Tensor]:
        """The staging buffer split per leaf (for per-leaf messages staged all at once)."""
        parts = self._parts.get(place)
        if parts is None:
            parts = self._parts[place] = (
                list(self.staging(place).split(self.nbytes)) if self.tensors else []
            )
        return parts

    def pieces(self, bucket_bytes: int, place: str = "cpu") -> list[Tensor]:
        """The staging buffer cut into messages of at most ``bucket_bytes`` bytes (cached)."""
        return self._bucket_layout(bucket_bytes, place).pieces

    def pack(self, bucket_bytes: int, place: str = "cpu") -> None:
        """Copy every leaf into the staging buffer on ``place`` (cut into messages of ``bucket_bytes``), in one
        op: in host memory one native call for every leaf (2000 x 8 KiB: 0.99 ms, a ``cat`` 1.73 ms).

        (Packing message by message while earlier ones travel loses on gloo,
        whose sends write to the socket from the caller's thread: measured again
        2026-12-06, 11.7-13.1 ms against 11.3 ms for 2000 x 8 KiB.) Off the CPU the
        copies are queued on the current stream.
        """
        if not self.tensors:
            return
        layout = self._bucket_layout(bucket_bytes, place)
        if layout.host:
            layout.packs.run(0, layout.bounds[-1])
        else:  # (off the CPU; or no byte to pack)
            torch._foreach_copy_(self.staging_parts(place), self.byte_views, non_blocking=True)

    def pack_piece(self, bucket_bytes: int, index: int, place: str) -> None:
        """Copy the leaves' bytes of message ``index`` into the staging buffer (one message at a time;
        in host memory one native call for all its leaves, about half the time of a ``cat``)."""
        layout = self._bucket_layout(bucket_bytes, place)
        if layout.host:
            layout.packs.run(layout.bounds[index], layout.bounds[index + 1])
        else:
            torch._foreach_copy_(
                layout.staging_parts[index], layout.leaf_parts[index], non_blocking=True
            )

    def unpack(self, bucket_bytes: int, index: int, place: str = "cpu") -> None:
        """Copy message ``index`` from the staging buffer into the leaves."""
        layout = self._bucket_layout(bucket_bytes, place)
        if layout.host:
            layout.unpacks.run(layout.bounds[index], layout.bounds[index + 1])
        else:
            torch._foreach_copy_(
                layout.leaf_parts[index], layout.staging_parts[index], non_blocking=True
            )

    def _bucket_layout(self, bucket_bytes: int, place: str) -> _Layout:
        return lru_get(
            self._pieces, (bucket_bytes, place), lambda: _Layout(self, bucket_bytes, place), CACHED
        )

    @cached_property
    def address_table(self) -> np.ndarray:
        """(address, bytes) of each leaf in send order, as ``struct iovec`` rows (host leaves: what a peer on this
        machine reads straight out of this process, :mod:`cudarecv.samehost.sides`)."""
        return np.array(
            [(t.data_ptr(), n) for t, n in zip(self.byte_views, self.nbytes)], dtype=np.uint64
        ).reshape(-1, 2)

    @cached_property
    def address_bytes(self) -> Tensor:
        """:attr:`address_table` as the bytes of one message."""
        return torch.from_numpy(self.address_table.view(np.uint8).reshape(-1))

    @cached_property
    def bucket_header(self) -> header.Header:
        digest = header.schema_digest(self.paths, self.tensors)
        return header.Header(
            header.KIND_BUCKETS,
            len(self.tensors),
            self.total,
            1,
            digest,
            describe=functools.partial(describe, header.KIND_BUCKETS, self.paths, self.tensors),
        )

    # -- consolidated ------------------------------------------------------------
    def storage(self, td: TensorDictBase) -> Tensor:
        """The consolidated storage of ``td``, checked to hold every leaf (cached)."""
        storage = self._storage
        consolidated = getattr(td, "_consolidated", None)
        current: Tensor | None = (
            consolidated.get("storage") if isinstance(consolidated, dict) else None
        )
        if storage is not None and current is storage:
            return storage
        if current is None:
            raise ArgumentError(
                "`consolidated=True` needs a consolidated tensordict: call "
                "`td = td.consolidate(metadata=True)` once (or build it with "
                "`TensorDict.from_remote_init`) and receive into that, every step"
            )
        start, end = current.data_ptr(), current.data_ptr() + current.numel()
        offsets = []
        for path, t, n in zip(self.paths, self.tensors, self.nbytes):
            if n == 0:  # an empty leaf holds no bytes (and has no data pointer): it is anywhere
                offsets.append(0)
                continue
            ptr = t.data_ptr()
            if not (start <= ptr and ptr + n <= end):
                raise ArgumentError(
                    f"leaf {format_path(path)!r} is not in the consolidated storage: the "
                    "tensordict changed after consolidate(); call `td.consolidate(metadata=True)` again"
                )
            offsets.append(ptr - start)
        self._storage = current
        self._chunk_header = header.Header(
            header.KIND_CHUNKS,
            len(self.tensors),
            current.numel(),
            1,
            header.schema_digest(self.paths, self.tensors, offsets, current.numel()),
            describe=functools.partial(
                describe, header.KIND_CHUNKS, self.paths, self.tensors, offsets, current.numel()
            ),
        )
        self._chunks: OrderedDict[int, list[Tensor]] = OrderedDict()
        return current

    def chunk_header(self, td: TensorDictBase) -> header.Header:
        self.storage(td)
        return self._chunk_header

    def chunks(self, td: TensorDictBase, bucket_bytes: int) -> list[Tensor]:
        """The consolidated storage cut into messages of at most ``bucket_bytes`` bytes (cached)."""
        storage = self.storage(td)
        return lru_get(
            self._chunks, bucket_bytes, lambda: header.cut(storage, bucket_bytes), CACHED
        )


_shape = operator.attrgetter("shape")


class _Layout:
    """A plan's staging on ``place`` cut into messages of ``bucket_bytes`` bytes: per message its staging slice
    and what it holds of the leaves (a leaf may span several messages): where leaves and staging are
    host memory, native copy tables that pack and unpack it (message i: rows ``bounds[i]`` to
    ``bounds[i + 1]``), else the matching leaf and staging views."""

    def __init__(self, plan: Plan, bucket_bytes: int, place: str) -> None:
        self.pieces = header.cut(plan.staging(place), bucket_bytes)
        self.host = (
            plan.device.type == "cpu" and bool(self.pieces) and self.pieces[0].device.type == "cpu"
        )
        self.leaf_parts: list[list[Tensor]] = [[] for _ in self.pieces]
        self.staging_parts: list[list[Tensor]] = [[] for _ in self.pieces]
        rows, counts = [], [0] * len(self.pieces)
        base = self.pieces[0].data_ptr() if self.host else 0
        offset = 0
        for view, n in zip(plan.byte_views, plan.nbytes):
            done = 0
            while done < n:
                index, at = divmod(offset + done, bucket_bytes)
                take = min(n - done, bucket_bytes - at)
                if (
                    self.host
                ):  # addresses only: thousands of views per layout would cost memory and time
                    rows.append((base + offset + done, view.data_ptr() + done, take))
                    counts[index] += 1
                else:
                    self.leaf_parts[index].append(view[done : done + take])
                    self.staging_parts[index].append(self.pieces[index][at : at + take])
                done += take
            offset += n
        self.packs = CopyTable(rows)
        self.unpacks = self.packs.reversed()
        self.bounds = [0, *itertools.accumulate(counts)]


_dtype = operator.attrgetter("dtype")


def _signature(tensors: list[Tensor]) -> tuple[list, ...]:
    """What a plan depends on in each leaf: data pointer (it moves with ``set_`` and the
    storage offset) and contiguity, then dtype and shape (for a contiguous leaf, the
    shape fixes the strides), all of which in-place ops can change on the same tensor.
    A leaf that is not plain (sparse, nested: refused by :meth:`Plan.check`) has None for
    all but its dtype: a strided nested tensor has no shape at all."""
    plain = [t.layout is torch.strided and not t.is_nested for t in tensors]
    return (
        [t.data_ptr() if ok else None for t, ok in zip(tensors, plain)],
        [t.is_contiguous() if ok else None for t, ok in zip(tensors, plain)],
        list(map(_dtype, tensors)),
        [t.shape if ok else None for t, ok in zip(tensors, plain)],
    )


def _unchanged(tensors: list[Tensor], signature: tuple[list, ...], layout: bool) -> bool:
    """Whether ``tensors`` still have ``signature``: data pointer and contiguity (about
    0.15 us per leaf), with ``layout`` dtype and shape too (about 0.4 us per leaf). The
    shapes are compared one by one and freed at once: a list of 2000 new shapes per call
    would set off the garbage collector's full passes, tens of ms each on a large heap."""
    ptrs, contiguous, dtypes, shapes = signature
    try:
        return (
            list(map(Tensor.data_ptr, tensors)) == ptrs
            and list(map(Tensor.is_contiguous, tensors)) == contiguous
            and (
                not layout
                or (
                    list(map(_dtype, tensors)) == dtypes
                    and all(map(operator.eq, map(_shape, tensors), shapes))
                )
            )
        )
    except RuntimeError:  # a leaf without data pointer or strides: compare in full
        return _signature(tensors) == signature


class _Guard(Protocol):
    def check(self, *tensors: Tensor) -> bool: ...


def _layout_guard(tensors: list[Tensor]) -> _Guard | Literal[False]:
    """torch's own C++ check that tensors still have the sizes, strides, dtype, device and dispatch keys they have
    now (``torch._C._dynamo.guards.TensorGuards``, with which ``torch.compile`` guards its inputs; every size and
    stride given, so none is left free), or False where this torch has none that takes these arguments and tells
    those changes apart (:func:`_guards_work`), or a leaf is not a plain strided tensor. It does not look at
    data pointers (:meth:`Plan.unchanged` compares those)."""
    if not _guards_work() or not all(
        t.layout is torch.strided and not t.is_nested for t in tensors
    ):
        return False
    try:
        guard = _make_guard(tensors)
        if guard.check(*tensors):
            return guard
    except Exception:  # noqa: BLE001 - a private API: another torch may lack it or want other arguments
        pass
    return False


def _make_guard(tensors: Sequence[Tensor]) -> _Guard:
    from torch._C._dynamo import guards

    make: Any = guards.TensorGuards  # (its stub's types are not the ones it takes here)
    return cast(
        _Guard,
        make(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        ),
    )


@functools.cache
def _guards_work() -> bool:
    """Whether this torch's ``TensorGuards``, made as :func:`_make_guard` makes it, passes a tensor like the one it
    was made from and fails one with another size, stride or dtype (asked once per process: a private API, whose
    meaning another torch may change)."""
    try:
        base = torch.zeros(4, 2)
        guard = _make_guard([base])
        changed = (
            torch.zeros(4, 3),
            torch.zeros(2, 4).t(),
            torch.zeros(8, 2)[::2],
            torch.zeros(4, 2, dtype=torch.int32),
        )
        return bool(guard.check(torch.zeros(4, 2))) and not any(guard.check(t) for t in changed)
    except Exception:  # noqa: BLE001 - (as in _layout_guard)
        return False


def _leaf_problem(t: Tensor, strided: bool = False) -> str | None:
    if t.is_nested:  # (strided or jagged)
        return "it is a nested tensor; store its components as separate leaves"
    if t.layout is not torch.strided:
        return f"its layout is {t.layout}; convert it with `.to_dense()`"
    if t.device.type == "meta":
        return "it is on the meta device and holds no data; materialize it with `.to_empty(device=...)`"
    if not t.is_contiguous() and not strided:
        return "it is not contiguous, and messages are contiguous bytes; call `td = td.contiguous()` once"
    return None


CACHED = 8  # entries per bounded cache of a plan (tags per init_tag, layouts per piece size)

_PLANS: dict[int, tuple[weakref.ref, Plan]] = {}


_LOCKED_KEY = "cudarecv_plan"


def plan_for(td: TensorDictBase, layout: bool = True) -> Plan:
    """The plan of ``td``, reused while its leaves are unchanged.

    A locked tensordict cannot change structure or swap leaves until it is
    unlocked, and unlocking erases its ``_cache``: there the plan is kept in
    that cache and reused without walking the leaves again (only the leaves'
    signatures are compared, which catches ``param.data = x``). An unlocked one
    made of plain tensordicts is checked against the :class:`~cudarecv.plan.walk.Skeleton` of
    its last walk (the same dicts, keys and leaf tensors) and the signatures; any
    other is walked each call, and its plan reused if the leaves are the same tensors.
    ``layout=False`` (a call that posts the leaves themselves) skips comparing
    dtypes and shapes.
    """
    locked = td.is_locked
    if locked:
        cache = getattr(td, "_cache", None)
        plan = cache.get(_LOCKED_KEY) if cache is not None else None
        if plan is not None and plan.unchanged(layout):
            return plan  # (a leaf given new storage, e.g. `param.data = x`, fails the check)
    key = id(td)
    entry = _PLANS.get(key)
    if entry is not None and entry[0]() is td:
        skeleton = entry[1].skeleton
        if skeleton is not None and skeleton.unchanged(td) and entry[1].unchanged(layout):
            return entry[
                1
            ]  # the same dicts, keys and leaf tensors: the walk would find the same leaves
    paths, tensors = walk(td)
    if entry is not None and entry[0]() is td and entry[1].matches(paths, tensors, layout):
        plan = entry[1]
    else:
        plan = Plan(paths, tensors)
        _PLANS[key] = (weakref.ref(td, functools.partial(_forget, key)), plan)
    if not locked:
        plan.skeleton = Skeleton.of(td)
    if locked:
        held: Any = (
            td  # (tensordict's private per-instance cache; its annotation there is not its value)
        )
        if held._cache is None:
            held._cache = defaultdict(dict)
        held._cache[_LOCKED_KEY] = plan
    return plan


def _forget(key: int, _: object) -> None:
    """The weakref callback of a cached plan: its tensordict is gone."""
    _PLANS.pop(key, None)


def forget_plan(td: TensorDictBase) -> Plan:
    """Drop the cached plan of ``td`` (its staging may be written late) and build a new one."""
    _PLANS.pop(id(td), None)
    cache = getattr(td, "_cache", None)
    if cache is not None:
        cache.pop(_LOCKED_KEY, None)
    return plan_for(td)
