"""Delta pushes' codec: a version as a *patch* against a base version the receiver holds, the words whose bits
changed, chosen per block by size.

The storage (uint8, laid out as the :class:`~cudarecv.weights.schema.Schema`: every leaf at a 16-byte offset) is
compared as *words* of ``word`` bytes (:func:`word_bytes`: the item size of the dtype that holds most of the
bytes, 2 for a bf16 model), and cut into blocks of :data:`BLOCK_BYTES`. Each block is sent the cheapest way for
the words of it that changed (``c`` of ``n``, ``W`` bytes each):

========  =====================================  ==================================
kind      what it sends                          bytes
========  =====================================  ==================================
SAME      nothing (no word changed)              0
SPARSE    each changed word's index, its value   ``c * (4 + W)``
BITMASK   a bit per word, the changed values     ``ceil(n / 8) + c * W``
FULL      the whole block                        ``n * W``
========  =====================================  ==================================

so at 1% of bf16 words changed a patch is about 3% of the version, and at 100% the sender sends the version
itself (:func:`encode` returns None when a patch would not be smaller). A patch is one buffer::

    prefix   32 B   magic b"CDRP", format, word bytes, words per block, blocks (a CRC'd record)
    kinds    blocks x uint8                       (padded to 8 bytes)
    counts   blocks x int64: changed words (FULL: the block's words)
    index    SPARSE blocks' changed words, int32 index in the block, in order      (padded to 8)
    bits     BITMASK blocks' bits, ceil(n / 8) bytes each, bit i of byte j: word 8j + i   (padded to 8)
    values   SPARSE blocks' changed words, then BITMASK blocks', in order          (padded to 8 each)
    full     FULL blocks' words, in order

:func:`apply` checks every field (lengths, kinds, counts, indices, bit counts) before it writes a byte, and writes
only into the storage it is given: a receiver patches its spare buffer, never the published one. Both run as
torch operations wherever the storages lie (CPU, or a GPU: no host round trip).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..core.errors import ChecksumError
from ..core.host_copy import library
from ..core.records import Record
from ..plan.header import cut, piece_sizes
from .relay import PATCH_BUFFER
from .schema import Schema

if TYPE_CHECKING:
    from .relay import Hop
    from .slots import Slot
    from .wire import PushHeader


class PatchError(ChecksumError):
    """A patch that does not apply: its fields disagree with each other or with the receiver's storage (corrupted
    on the way, or a bug). Nothing was published; the receiver keeps its version."""


#: the bytes of one block (a kind per block): 1 MiB, so a model of G GiB has 1024 G blocks, 9 bytes each in the
#: patch, and a block's index fits an int32 whatever the word
BLOCK_BYTES = 1 << 20
FORMAT = 1
#: the largest message a patch travels in: a relay chain forwards a message once it has all of it, so a small
#: patch (a few MiB) in the sender's 1 MiB chunks would wait a chunk's time on each hop
PATCH_MESSAGE = 256 << 10
PREFIX = Record(
    "weight patch", b"CDRP", "IIQQ", size=32, error=PatchError, hint="the patch is corrupted"
)
WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS = torch.arange(8, dtype=torch.uint8)
_BITS = 1 << _SHIFTS


def _native() -> ctypes.CDLL | None:
    """The native codec's calls (``native/delta.c``), declared on the library; None where cudarecv was built
    without a C compiler (torch does the same work, slower). Called once: :data:`NATIVE`."""
    lib = library()
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    calls: dict[str, tuple[list[type], type | None]] = {
        # (new, base, words, word, block_words, first, last, counts)
        "cudarecv_delta_counts": ([ptr, ptr, i64, i32, i64, i64, i64, ptr], None),
        # (new, base, advance, words, word, block_words, first, last, kinds, 5 sections)
        "cudarecv_delta_gather": ([ptr, ptr, i32, i64, i32, i64, i64, i64, ptr, *[ptr] * 5], None),
        # (words, block_words, kinds, counts, index, bits)
        "cudarecv_delta_check": ([i64, i64, ptr, ptr, ptr, ptr], i64),
        # (into, words, word, block_words, kinds, counts, 5 sections)
        "cudarecv_delta_apply": ([ptr, i64, i32, i64, ptr, ptr, *[ptr] * 5], None),
    }
    for name, (argtypes, restype) in calls.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


NATIVE = _native()


class Block(enum.IntEnum):
    """How one block travels in a patch (see the module docstring)."""

    SAME = 0
    SPARSE = 1
    BITMASK = 2
    FULL = 3


def patch_message(bucket_bytes: int) -> int:
    """The bytes of a patch's messages for a session of ``bucket_bytes`` (both ends compute it)."""
    return min(bucket_bytes, PATCH_MESSAGE)


def word_bytes(schema: Schema) -> int:
    """The word a schema's versions are compared in: the item size (at most 8) of the dtype holding most bytes.
    Any of 1, 2, 4, 8 is correct for any schema (offsets and the total are multiples of 16); this one makes a
    changed element one word for most of the model."""
    by_size: dict[int, int] = {}
    for leaf in schema.leaves:
        size = min(leaf.dtype.itemsize, 8)
        by_size[size] = by_size.get(size, 0) + leaf.nbytes
    return max(by_size, key=lambda size: (by_size[size], size)) if by_size else 1


def _pad(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class Layout:
    """Where a patch's sections lie, from its kinds and counts (both ends compute it the same way)."""

    words: int
    block_words: int
    kinds: Tensor  # uint8 [blocks]
    counts: Tensor  # int64 [blocks]
    sizes: Tensor  # int64 [blocks]: words per block (the last may be short)
    sparse: int  # changed words of SPARSE blocks
    bits: int  # bytes of BITMASK blocks' bits
    marked: int  # changed words of BITMASK blocks
    full: int  # words of FULL blocks

    @classmethod
    def of(cls, words: int, block_words: int, kinds: Tensor, counts: Tensor) -> Layout:
        blocks = kinds.numel()
        sizes = torch.full((blocks,), block_words, dtype=torch.int64, device=kinds.device)
        if blocks and words % block_words:
            sizes[-1] = words % block_words
        sparse, bitmask, full = (
            (kinds == Block.SPARSE),
            (kinds == Block.BITMASK),
            (kinds == Block.FULL),
        )
        totals = torch.stack(
            [
                (counts * sparse).sum(),
                ((sizes + 7) // 8 * bitmask).sum(),
                (counts * bitmask).sum(),
                (sizes * full).sum(),
            ]
        ).tolist()  # (one read back from a device)
        return cls(words, block_words, kinds, counts, sizes, *totals)

    def offsets(self, word: int) -> list[int]:
        """Byte offsets of the sections (kinds, counts, index, bits, sparse values, marked values, full) and the
        end."""
        blocks = self.kinds.numel()
        at, out = PREFIX.size, []
        for length in (
            blocks,
            8 * blocks,
            4 * self.sparse,
            self.bits,
            word * self.sparse,
            word * self.marked,
        ):
            out.append(at)
            at += _pad(length)
        out.append(at)
        return [*out, at + word * self.full]


def encode(
    new: Tensor,
    base: Tensor,
    word: int,
    out: Tensor | None = None,
    native: bool = True,
    advance: bool = False,
) -> Tensor | None:
    """The patch that turns ``base`` into ``new`` (uint8 storages of the same length, a multiple of ``word``), in
    ``out`` (uint8; a new tensor of the patch's length if None or shorter), as a view of its first bytes; None
    when a patch would not be smaller than ``new`` itself (send the version whole). ``advance``: ``base`` then
    holds ``new`` (the native codec writes only the changed words). Host storages take the native codec where it
    was built (``native=False``: torch's, as on a device)."""
    words, block_words = new.numel() // word, BLOCK_BYTES // word
    blocks = -(-words // block_words)
    lib = NATIVE if native and new.device.type == "cpu" else None
    parts = _parts(blocks, new.numel())
    if lib is not None:
        counts = torch.empty(blocks, dtype=torch.int64)
        _parallel(
            lambda first, last: lib.cudarecv_delta_counts(
                new.data_ptr(),
                base.data_ptr(),
                words,
                word,
                block_words,
                first,
                last,
                counts.data_ptr(),
            ),
            parts,
        )
        changed = None
    else:
        changed = new.view(WORD_DTYPES[word]) != base.view(WORD_DTYPES[word])
        counts = _block_sums(changed, block_words)
    kinds = _kinds(counts, words, block_words, word)
    layout = Layout.of(words, block_words, kinds, counts)
    at = layout.offsets(word)
    if at[-1] >= new.numel():
        if advance:
            base.copy_(new)
        return None
    if out is None or out.numel() < at[-1]:
        out = torch.empty(at[-1], dtype=torch.uint8, device=new.device)
    patch = out[: at[-1]]
    prefix = PREFIX.pack(FORMAT, word, block_words, blocks)
    patch[: PREFIX.size].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    patch[at[0] : at[0] + blocks].copy_(kinds)
    patch[at[1] : at[1] + 8 * blocks].view(torch.int64).copy_(
        torch.where(kinds == Block.FULL, layout.sizes, counts)  # (FULL: the block's words)
    )
    ends = [at[0] + blocks, at[1] + 8 * blocks, at[2] + 4 * layout.sparse, at[3] + layout.bits]
    ends += [at[4] + word * layout.sparse, at[5] + word * layout.marked]
    for end, start in zip(
        ends, at[1:]
    ):  # the padding after each section: none of the process's memory
        patch[end:start].zero_()
    if lib is not None:
        patch[at[3] : at[3] + layout.bits].zero_()
        starts = _section_starts(layout, word, at, parts)
        _parallel(
            lambda first, last: lib.cudarecv_delta_gather(
                new.data_ptr(),
                base.data_ptr(),
                advance,
                words,
                word,
                block_words,
                first,
                last,
                kinds.data_ptr(),
                *(patch.data_ptr() + a if a < patch.numel() else 0 for a in starts[first]),
            ),
            parts,
        )
    else:
        assert changed is not None
        _gather(new.view(WORD_DTYPES[word]), changed, patch, layout, at, word)
        if advance:
            base.copy_(new)
    return patch


#: host storages at least this large are diffed by several threads (each a range of blocks; the native codec
#: runs without the GIL)
PARALLEL_BYTES = 16 << 20
#: at most this many threads (the caller's, and the rest started and joined within the call)
THREADS = 4


def _parts(blocks: int, nbytes: int) -> list[tuple[int, int]]:
    """The ranges of blocks the threads of a host diff take, one each: as many as the cores this process may run
    on, at most :data:`THREADS` (not torch's thread count: a rank of several on one machine often sets it to 1,
    for torch's own pool)."""
    count = min(THREADS, len(os.sched_getaffinity(0)), blocks) if nbytes >= PARALLEL_BYTES else 1
    bounds = [blocks * i // max(count, 1) for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [(0, 0)]


def _parallel(call: Callable[[int, int], object], parts: list[tuple[int, int]]) -> None:
    """``call(first, last)`` for every range of ``parts``, the first on this thread, the others on threads of
    their own (started and joined here; an error on any is raised here)."""
    errors: list[BaseException] = []

    def run(first: int, last: int) -> None:
        try:
            call(first, last)
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=part, daemon=True) for part in parts[1:]]
    for thread in threads:
        thread.start()
    run(*parts[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _section_starts(
    layout: Layout, word: int, at: list[int], parts: list[tuple[int, int]]
) -> dict[int, list[int]]:
    """For the first block of each part: where in the patch its index, bits, values and full words begin (the
    sections' starts plus what the blocks before it take of each)."""
    kinds, counts, sizes = layout.kinds, layout.counts, layout.sizes
    sparse, bitmask, full = (kinds == Block.SPARSE), (kinds == Block.BITMASK), (kinds == Block.FULL)
    per_block = torch.stack(
        [
            4 * counts * sparse,
            (sizes + 7) // 8 * bitmask,
            word * counts * sparse,
            word * counts * bitmask,
            word * sizes * full,
        ]
    )
    before = torch.cat([torch.zeros(5, 1, dtype=torch.int64), per_block.cumsum(1)], 1)
    return {
        first: [a + int(b) for a, b in zip(at[2:7], before[:, first].tolist())]
        for first, _ in parts
    }


def _block_sums(changed: Tensor, block_words: int) -> Tensor:
    """Each block's count of changed words."""
    rows = changed.numel() // block_words
    counts = changed[: rows * block_words].view(rows, block_words).sum(1)
    if changed.numel() % block_words:
        counts = torch.cat([counts, changed[rows * block_words :].sum().view(1)])
    return counts


def _gather(
    new_w: Tensor, changed: Tensor, patch: Tensor, layout: Layout, at: list[int], word: int
) -> None:
    """Torch's gather of the patch's sections (what ``cudarecv_delta_gather`` does on host memory)."""
    kinds, block_words = layout.kinds, layout.block_words
    rows, tail = divmod(layout.words, block_words)
    grid = changed[: rows * block_words].view(rows, block_words)
    full_rows = kinds[:rows] == Block.FULL
    grid[full_rows] = False  # (changed words of FULL blocks travel as the block)
    if tail and kinds[-1] == Block.FULL:
        changed[rows * block_words :] = False
    where = changed.nonzero().squeeze(1)
    kind_of = kinds[where // block_words]
    sparse, marked = where[kind_of == Block.SPARSE], where[kind_of == Block.BITMASK]
    patch[at[2] : at[2] + 4 * layout.sparse].view(torch.int32).copy_(sparse % block_words)
    _section(patch, at[4], word, layout.sparse).copy_(new_w[sparse])
    _section(patch, at[5], word, layout.marked).copy_(new_w[marked])
    bits = [_pack(grid[kinds[:rows] == Block.BITMASK])]
    if tail and kinds[-1] == Block.BITMASK:
        bits.append(_pack(changed[rows * block_words :]))
    patch[at[3] : at[3] + layout.bits].copy_(torch.cat(bits))
    full = [new_w[: rows * block_words].view(rows, block_words)[full_rows].reshape(-1)]
    if tail and kinds[-1] == Block.FULL:
        full.append(new_w[rows * block_words :])
    _section(patch, at[6], word, layout.full).copy_(torch.cat(full))


def _kinds(counts: Tensor, words: int, block_words: int, word: int) -> Tensor:
    """Each block's cheapest kind for ``counts`` changed words."""
    sizes = torch.full_like(counts, block_words)
    if words % block_words:
        sizes[-1] = words % block_words
    costs = torch.stack([counts * (4 + word), (sizes + 7) // 8 + counts * word, sizes * word])
    kinds = (costs.argmin(0) + 1).to(torch.uint8)
    return torch.where(counts == 0, int(Block.SAME), kinds).to(torch.uint8)


def _pack(mask: Tensor) -> Tensor:
    """A bool tensor's rows (or one row) as bits, ``ceil(n / 8)`` bytes a row, flattened."""
    rows = mask if mask.dim() > 1 else mask.view(1, -1)
    n = rows.shape[1]
    if rows.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=mask.device)
    if n % 8:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 8 - n % 8)], 1)
    bits = _BITS.to(rows.device)
    return (
        (rows.reshape(rows.shape[0], -1, 8).to(torch.uint8) * bits)
        .sum(-1, dtype=torch.uint8)
        .reshape(-1)
    )


def _section(patch: Tensor, start: int, word: int, count: int) -> Tensor:
    return patch[start : start + word * count].view(WORD_DTYPES[word])


def apply(patch: Tensor, into: Tensor, word: int, native: bool = True) -> None:
    """Write ``patch`` (uint8, as :func:`encode` made it) into ``into`` (uint8, the base version, on the same
    device); raises :class:`PatchError` before writing anything if a field is off. Host storages take the native
    codec where it was built (``native=False``: torch's, as on a device)."""
    raw = bytes(patch[: PREFIX.size].cpu().numpy()) if patch.numel() >= PREFIX.size else b""
    if len(raw) < PREFIX.size:
        raise PatchError(
            f"a patch of {patch.numel()} bytes is shorter than its prefix: the patch is corrupted"
        )
    fmt, got_word, block_words, blocks = PREFIX.unpack(raw)
    words = into.numel() // word
    if (
        fmt != FORMAT
        or got_word != word
        or not 8 <= block_words <= 1 << 31
        or block_words % 8
        or blocks != -(-words // block_words)
    ):
        raise PatchError(
            f"a patch of format {fmt} in {got_word}-byte words, {blocks} blocks of {block_words} does not fit "
            f"{words} words of {word} bytes: the patch is corrupted"
        )
    if patch.numel() < PREFIX.size + _pad(blocks) + 8 * blocks:
        raise PatchError(
            f"a patch of {patch.numel()} bytes cannot hold {blocks} blocks' kinds and counts"
        )
    at = PREFIX.size
    kinds = patch[at : at + blocks]
    counts = patch[at + _pad(blocks) : at + _pad(blocks) + 8 * blocks].view(torch.int64)
    if bool((kinds > Block.FULL).any()):
        raise PatchError("a patch names a block kind that does not exist: the patch is corrupted")
    layout = Layout.of(words, block_words, kinds, counts)
    bad = (
        (counts < 0)
        | (counts > layout.sizes)
        | ((kinds == Block.SAME) & (counts != 0))
        | ((kinds == Block.FULL) & (counts != layout.sizes))
        | (((kinds == Block.SPARSE) | (kinds == Block.BITMASK)) & (counts == 0))
    )
    at_ = layout.offsets(word)
    if bool(bad.any()) or at_[-1] != patch.numel():
        raise PatchError(
            f"a patch of {patch.numel()} bytes whose blocks' counts say {at_[-1]}: the patch is corrupted"
        )
    lib = NATIVE if native and into.device.type == "cpu" else None
    if lib is None:
        _apply(patch, into, word, layout, at_)
        return
    sections = [patch[a].data_ptr() if a < patch.numel() else 0 for a in at_[2:7]]
    bad_block = lib.cudarecv_delta_check(
        words, block_words, kinds.data_ptr(), counts.data_ptr(), sections[0], sections[1]
    )
    if bad_block:
        raise PatchError(
            f"block {-1 - bad_block} of a patch has an index outside it, indices out of order, or bits that "
            "disagree with its count: the patch is corrupted"
        )
    lib.cudarecv_delta_apply(
        into.data_ptr(), words, word, block_words, kinds.data_ptr(), counts.data_ptr(), *sections
    )


def _apply(patch: Tensor, into: Tensor, word: int, layout: Layout, at_: list[int]) -> None:
    """Torch's check and write of a patch whose kinds and counts were checked (``cudarecv_delta_check`` and
    ``cudarecv_delta_apply`` on host memory)."""
    kinds, counts, words, block_words = (
        layout.kinds,
        layout.counts,
        layout.words,
        layout.block_words,
    )
    rows = words // block_words
    # where each SPARSE word goes, checked inside its block
    sparse_blocks = (kinds == Block.SPARSE).nonzero().squeeze(1)
    in_block = patch[at_[2] : at_[2] + 4 * layout.sparse].view(torch.int32).to(torch.int64)
    block_of = sparse_blocks.repeat_interleave(counts[sparse_blocks])
    if bool(((in_block < 0) | (in_block >= layout.sizes[block_of])).any()):
        raise PatchError("a patch's index lies outside its block: the patch is corrupted")
    sparse_at = block_of * block_words + in_block
    # where each BITMASK word goes: its bits, checked against its count and its block's length
    marked_blocks = (kinds == Block.BITMASK).nonzero().squeeze(1)
    bits = patch[at_[3] : at_[3] + layout.bits]
    lengths = ((layout.sizes[marked_blocks] + 7) // 8).tolist()
    marked_at, seen = [], []
    for blocks_, chunk in _bit_runs(marked_blocks, bits, lengths, rows, block_words):
        mask = ((chunk.view(len(blocks_), -1)[..., None] >> _SHIFTS.to(chunk.device)) & 1).bool()
        mask = mask.view(len(blocks_), -1)
        if (
            int(blocks_[-1]) == rows and mask[-1, words - rows * block_words :].any()
        ):  # the short last block
            raise PatchError("a patch marks a word past its block's end: the patch is corrupted")
        mask = mask[:, :block_words]
        seen.append(mask.sum(1))
        local = mask.nonzero()
        marked_at.append(blocks_[local[:, 0]] * block_words + local[:, 1])
    if seen and not torch.equal(torch.cat(seen), counts[marked_blocks]):
        raise PatchError("a patch's bits disagree with its counts: the patch is corrupted")
    into_w = into.view(WORD_DTYPES[word])
    into_w[sparse_at] = _section(patch, at_[4], word, layout.sparse)
    if marked_at:
        into_w[torch.cat(marked_at)] = _section(patch, at_[5], word, layout.marked)
    full_rows = (kinds[:rows] == Block.FULL).nonzero().squeeze(1)
    full = _section(patch, at_[6], word, layout.full)
    into_w[: rows * block_words].view(rows, block_words)[full_rows] = full[
        : full_rows.numel() * block_words
    ].view(-1, block_words)
    if words % block_words and kinds[-1] == Block.FULL:
        into_w[rows * block_words :] = full[full_rows.numel() * block_words :]


def _bit_runs(
    blocks: Tensor, bits: Tensor, lengths: list[int], rows: int, block_words: int
) -> list[tuple[Tensor, Tensor]]:
    """The BITMASK blocks' bits in runs of equal length: the whole blocks' together, the short last one apart."""
    if not lengths:
        return []
    whole = sum(1 for b in blocks.tolist() if b < rows)
    runs = [(blocks[:whole], bits[: whole * (block_words // 8)])] if whole else []
    if whole < len(lengths):
        runs.append((blocks[whole:], bits[whole * (block_words // 8) :]))
    return runs


@dataclass(frozen=True)
class _Applied:
    """The last patch a receiver applied: from version ``base`` to ``version``, its bytes (kept in its buffer)."""

    base: int
    version: int
    patch: Tensor


class Patches:
    """Delta, a receiver's: the two buffers patches land in, in turn (each as large as the largest patch it held:
    a patch is always smaller than the version), and their application into the slot the next version lands in.

    That slot holds the version before the published one when the pulls before were whole: the last patch (kept
    in the other buffer) is applied to it first, then the new one, and the version is never copied; else the
    published version is copied into it first. A relayed patch is forwarded from its buffer: a patch lands only
    once the last forward no longer reads (and a buffer a failed forward may still read is never written again)."""

    def __init__(self, schema: Schema, device: torch.device, pin_memory: bool) -> None:
        self.word, self.total = word_bytes(schema), schema.total
        self.device, self.pin_memory = device, pin_memory
        self._buffers: list[Tensor | None] = [None, None]
        self._turn = 0  # the buffer the next patch lands in
        self._applied: _Applied | None = None
        #: the version each own slot's bytes hold (by id; none while one is being written), and what the slot
        #: the pull under way writes held before
        self._holds: dict[int, int] = {}
        self._was: int | None = None
        #: a placed slot's version as one storage, to patch (allocated at its first patch)
        self._whole: Tensor | None = None

    def sizes(self, header: PushHeader, schema: Schema) -> list[int]:
        """The byte count of each message of ``header``'s push (a patch's, or the version's), to drain it."""
        if header.patch:
            return piece_sizes(header.patch, patch_message(header.bucket_bytes))
        return schema.message_sizes(header.bucket_bytes)

    def pieces(self, nbytes: int, bucket_bytes: int, hop: Hop) -> list[Tensor]:
        """The messages a patch of ``nbytes`` (less than the version's) lands in, once the forward of the last
        relayed patch (``hop``'s) no longer reads them."""
        forward = hop.forward_of(PATCH_BUFFER)
        if forward is not None:
            with contextlib.suppress(Exception):
                forward.wait()  # bounded by its own timeout
            if forward.failed:  # its parked send may read the buffers for as long as it likes
                self.renew()
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.numel() < nbytes:  # (it grows to the largest patch)
            buffer = self._buffers[self._turn] = torch.empty(
                nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory
            )
        return cut(buffer[:nbytes], patch_message(bucket_bytes))

    def renew(self) -> None:
        """Receives or a forward may still touch the buffers for good: never write them again (the next patch
        lands in a new one)."""
        self._buffers, self._applied = [None, None], None

    def clear(self) -> None:
        """The receiver closed: let go of every buffer (a pull still under way keeps what it holds)."""
        self.renew()
        self._whole, self._holds = None, {}

    def writing(self, slot: Slot) -> None:
        """A pull starts writing into ``slot``: it holds no version until it is published (what it held, the
        patch of this pull may start from)."""
        self._was = self._holds.pop(id(slot), None)

    def rejected(self) -> None:
        """The version this pull patched was rejected (its digest): its patch is no base for the next one."""
        self._applied = None

    def published(self, slot: Slot, version: int) -> None:
        """A pull published ``version`` in ``slot``."""
        self._holds[id(slot)] = version

    def apply(
        self,
        header: PushHeader,
        slot: Slot,
        published: Slot | None,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Write version ``header.base`` (``published``'s, checked by the caller) and then ``header``'s patch,
        which landed, into ``slot``; raises :class:`PatchError` if the patch does not apply (``slot`` is then
        unpublished rubbish, the published version untouched)."""
        buffer = self._buffers[self._turn]
        if published is None or buffer is None:
            raise PatchError("a patch came before any version was published")
        patch, last = buffer[: header.patch], self._applied
        self._applied = None  # (until this one applied)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if slot.placed:
                # leaves that lie where their owner put them (a sharded receiver's): patched in one storage laid
                # out as the schema, then copied to their places
                if self._whole is None:
                    self._whole = torch.zeros(self.total, dtype=torch.uint8, device=self.device)
                published.copy_to(self._whole)
                apply(patch, self._whole, self.word)
                slot.fill(self._whole)
            elif last is not None and last.version == header.base and self._was == last.base:
                apply(
                    last.patch, slot.storage, self.word
                )  # (it turned the slot's version into the base)
                apply(patch, slot.storage, self.word)
            else:
                slot.fill(published.storage)
                apply(patch, slot.storage, self.word)
        self._applied = _Applied(header.base, header.version, patch)
        self._turn ^= 1
