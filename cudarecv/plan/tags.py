"""Bit-exact, vectorized twin of tensordict's pseudo-random p2p tags.

tensordict (``tensordict.utils._int_generator``) derives a tag as::

    int.from_bytes(np.random.default_rng(seed).bytes(8), "big") % 10_000

which costs ~16 us per call. Here numpy's ``SeedSequence`` (hash/mix in uint32)
and ``PCG64`` seeding plus one output (128-bit LCG as two uint64 halves, the
high part of 64x64 products from 32-bit limbs) are replayed on whole arrays of
seeds at once.

Only numpy is imported here so that ``import cudarecv.plan.tags`` stays cheap.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
import os
import sys
from collections.abc import Iterable

import numpy as np

from ..core.errors import ArgumentError, ArgumentTypeError

__all__ = ["MAX_TAG", "int_generator_many", "tag_map", "tag_sequence"]

#: ``_int_generator`` returns values in ``0 .. MAX_TAG - 1``.
MAX_TAG = 10_000

_M32 = 0xFFFFFFFF
# numpy/random/bit_generator.pyx (SeedSequence).
_POOL_SIZE = 4
_INIT_A = 0x43B0D7E5
_MULT_A = 0x931E8875
_INIT_B = 0x8B51F9DD
_MULT_B = 0x58F38DED
_MIX_MULT_L = np.uint32(0xCA01F9DD)
_MIX_MULT_R = np.uint32(0x4973F715)
_XSHIFT = np.uint32(16)
# numpy/random/src/pcg64 (PCG_DEFAULT_MULTIPLIER_128) as 64-bit halves; low half split in 32-bit limbs.
_PCG_HI = np.uint64(2549297995355413924)
_PCG_LO = np.uint64(4865540595714422341)
_PCG_LO_LO = np.uint64(4865540595714422341 & _M32)
_PCG_LO_HI = np.uint64(4865540595714422341 >> 32)
_U64_1 = np.uint64(1)
_U64_32 = np.uint64(32)
_U64_63 = np.uint64(63)
_U64_M32 = np.uint64(_M32)


def _hash_consts(start: int, mult: int, count: int) -> list[np.uint32]:
    """The successive multipliers ``h *= mult`` used by hashmix (data independent)."""
    out, h = [], start
    for _ in range(count):
        h = (h * mult) & _M32
        out.append(np.uint32(h))
    return out


@functools.cache
def _hashmix_plan(n_words: int) -> tuple[list[np.uint32], list[np.uint32]]:
    """XOR constants and multipliers of every hashmix call for ``n_words`` entropy words.

    hashmix(v) = ((v ^ h_old) * h_new) ^ (... >> 16) with ``h_new = h_old * MULT_A``.
    """
    calls = _POOL_SIZE + _POOL_SIZE * (_POOL_SIZE - 1) + max(0, n_words - _POOL_SIZE) * _POOL_SIZE
    mults = _hash_consts(_INIT_A, _MULT_A, calls)
    xors = [np.uint32(_INIT_A)] + mults[:-1]
    return xors, mults


_STATE_MULTS = _hash_consts(_INIT_B, _MULT_B, 8)
_STATE_XORS = [np.uint32(_INIT_B)] + _STATE_MULTS[:-1]


def _pool(words: np.ndarray) -> list[np.ndarray]:
    """SeedSequence.mix_entropy on ``words`` (shape ``(n_words, N)``, uint32): 4 pool rows."""
    n_words = words.shape[0]
    xors, mults = _hashmix_plan(n_words)
    calls = iter(zip(xors, mults))

    def hashmix(v: np.ndarray) -> np.ndarray:
        x, m = next(calls)
        v = (v ^ x) * m
        return v ^ (v >> _XSHIFT)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = _MIX_MULT_L * x - _MIX_MULT_R * y
        return r ^ (r >> _XSHIFT)

    zero = np.zeros(words.shape[1], dtype=np.uint32)
    # Missing words hash as 0, exactly like numpy's "keep running the hash out".
    pool = [hashmix(words[i] if i < n_words else zero) for i in range(_POOL_SIZE)]
    for i_src in range(_POOL_SIZE):
        for i_dst in range(_POOL_SIZE):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(_POOL_SIZE, n_words):
        for i_dst in range(_POOL_SIZE):
            pool[i_dst] = mix(pool[i_dst], hashmix(words[i_src]))
    return pool


def _mulhi64(a: np.ndarray, c_lo: np.uint64, c_hi: np.uint64) -> np.ndarray:
    """High 64 bits of ``a * c`` for uint64 ``a`` and a constant ``c = c_hi << 32 | c_lo``."""
    a_lo, a_hi = a & _U64_M32, a >> _U64_32
    p_ll, p_lh, p_hl = a_lo * c_lo, a_lo * c_hi, a_hi * c_lo  # each < 2**64: exact
    mid = (p_ll >> _U64_32) + (p_lh & _U64_M32) + (p_hl & _U64_M32)  # < 3 * 2**32
    return a_hi * c_hi + (p_lh >> _U64_32) + (p_hl >> _U64_32) + (mid >> _U64_32)


def _pcg_step(
    hi: np.ndarray, lo: np.ndarray, inc_hi: np.ndarray, inc_lo: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``state = state * PCG_MULT + inc  (mod 2**128)`` with uint64 halves (numpy wraps mod 2**64)."""
    new_lo = lo * _PCG_LO
    new_hi = _mulhi64(lo, _PCG_LO_LO, _PCG_LO_HI) + lo * _PCG_HI + hi * _PCG_LO
    sum_lo = new_lo + inc_lo
    return new_hi + inc_hi + (sum_lo < new_lo), sum_lo


def _tags_from_words(words: np.ndarray) -> np.ndarray:
    """Tags for seeds given as uint32 words (shape ``(n_words, N)``, little-endian word order)."""
    pool = _pool(words)
    # SeedSequence.generate_state(4, uint64): 8 uint32 words cycling over the pool.
    st = []
    for i, (x, m) in enumerate(zip(_STATE_XORS, _STATE_MULTS)):
        v = (pool[i % _POOL_SIZE] ^ x) * m
        st.append((v ^ (v >> _XSHIFT)).astype(np.uint64))
    w = [st[2 * k] | (st[2 * k + 1] << _U64_32) for k in range(4)]
    # pcg64_set_seed: initstate = w0 << 64 | w1, initseq = w2 << 64 | w3, then srandom:
    # inc = initseq << 1 | 1; state = 0; step; state += initstate; step.
    inc_hi = (w[2] << _U64_1) | (w[3] >> _U64_63)
    inc_lo = (w[3] << _U64_1) | _U64_1
    lo = inc_lo + w[1]
    hi = inc_hi + w[0] + (lo < inc_lo)
    hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
    # Generator.bytes(8): one 64-bit draw (step, then XSL-RR), as little-endian bytes.
    hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
    x = hi ^ lo
    rot = hi >> np.uint64(58)
    out = (x >> rot) | (x << ((np.uint64(64) - rot) & _U64_63))
    # tensordict reads those bytes big-endian.
    return (out.byteswap() % np.uint64(MAX_TAG)).astype(np.int64)


def _words_of_uint64(seeds: np.ndarray) -> np.ndarray:
    seeds = seeds.astype(np.uint64, copy=False)
    return np.stack([(seeds & _U64_M32).astype(np.uint32), (seeds >> _U64_32).astype(np.uint32)])


def int_generator_many(seeds: Iterable[int] | np.ndarray) -> np.ndarray:
    """``tensordict.utils._int_generator`` applied to every seed, vectorized.

    ``seeds`` are non-negative integers of any size (Python ints or an integer
    array). Returns an int64 array of the same length with values in ``0..9999``.

    >>> from cudarecv.p2p.stock import int_generator as _int_generator
    >>> int_generator_many([10, 2**70]).tolist() == [_int_generator(10), _int_generator(2**70)]
    True
    """
    if isinstance(seeds, np.ndarray):
        arr = seeds.reshape(-1)
        if arr.dtype == np.bool_ or not (
            np.issubdtype(arr.dtype, np.integer) or arr.dtype == object
        ):
            raise ArgumentTypeError(
                f"seeds must be non-negative integers, got an array of dtype {arr.dtype}"
            )
    else:
        values = list(seeds)
        arr = np.array(values)
        # Ints beyond int64 make numpy pick float64 (lossy) or object: check them one by one.
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.signedinteger) and (arr < 0).any():
            raise ArgumentError(
                "seeds must be non-negative: numpy's SeedSequence rejects negative ints"
            )
        # Seeds below 2**128 all hash like 4 words (missing words hash as 0).
        return _tags_from_words(_words_of_uint64(arr))
    return _int_generator_objects(arr)


def _int_generator_objects(arr: np.ndarray) -> np.ndarray:
    """Slow-ish path for Python ints (possibly >= 2**64): group by 32-bit word count."""
    values = []
    for v in arr.tolist():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ArgumentTypeError(f"seeds must be non-negative integers, got {type(v).__name__}")
        v = operator.index(v)
        if v < 0:
            raise ArgumentError(
                "seeds must be non-negative: numpy's SeedSequence rejects negative ints"
            )
        values.append(v)
    n_words = np.array([max(_POOL_SIZE, (v.bit_length() + 31) // 32) for v in values])
    out = np.empty(len(values), dtype=np.int64)
    for k in np.unique(n_words).tolist():
        idx = np.flatnonzero(n_words == k)
        group = [values[i] for i in idx.tolist()]
        words = np.array(
            [[(v >> (32 * w)) & _M32 for v in group] for w in range(k)], dtype=np.uint32
        )
        out[idx] = _tags_from_words(words)
    return out


@functools.cache
def tag_map() -> np.ndarray:
    """Read-only int64 array ``M`` with ``M[s] == _int_generator(s)`` for ``s in 0..10000``.

    Computed once per process: by the cupy kernel of ``kernels/int_generator.cu``
    when this process already uses CUDA and cupy is installed (set
    ``CUDARECV_TAG_KERNEL=0`` to opt out), else by the numpy twin (~1 ms). Both
    give the same array; a failing kernel falls back to numpy. Whether CUDA is
    in use is read from torch without initializing anything, so a CPU-only
    process never pays for cupy.
    """
    out = None
    if _kernel_wanted():
        try:
            from ..cuda.tag_kernel import tag_map_gpu

            out = np.asarray(tag_map_gpu(), dtype=np.int64)
        except Exception:  # noqa: BLE001 - the numpy twin gives the same map
            out = None
    if out is None:
        out = int_generator_many(np.arange(MAX_TAG + 1, dtype=np.uint64))
    out.flags.writeable = False
    return out


def _kernel_wanted() -> bool:
    """cupy installed and CUDA already initialized in this process (checked without side effects)."""
    if os.environ.get("CUDARECV_TAG_KERNEL", "1") == "0":
        return False
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    return importlib.util.find_spec("cupy") is not None


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be an int, got {type(value).__name__} ({value!r}); pass e.g. {name}=0"
        )
    return int(value)


def tag_sequence(init_tag: int, n: int, *, pseudo_rand: bool = False) -> np.ndarray:
    """Tags stock tensordict uses for ``n`` leaves sent/received with ``init_tag``.

    Without ``pseudo_rand``: ``init_tag, init_tag + 1, ...``. With it, the chain
    ``t = init_tag - 1; t = _int_generator(t + 1)`` per leaf, computed from
    :func:`tag_map` with cycle detection (so ``n`` can be huge). Returns a new
    int64 array of length ``n``.

    >>> tag_sequence(5, 3).tolist()
    [5, 6, 7]
    >>> from cudarecv.p2p.stock import int_generator as _int_generator
    >>> tag_sequence(10, 2, pseudo_rand=True).tolist() == [
    ...     _int_generator(10), _int_generator(_int_generator(10) + 1)]
    True
    """
    init_tag = _check_int("init_tag", init_tag)
    n = _check_int("n", n)
    if n < 0:
        raise ArgumentError(f"n must be >= 0 (the number of leaves), got {n}")
    if not isinstance(pseudo_rand, (bool, np.bool_)):
        raise ArgumentTypeError(f"pseudo_rand must be a bool, got {type(pseudo_rand).__name__}")
    if not pseudo_rand:
        if n and not (init_tag >= -(2**63) and init_tag + n - 1 < 2**63):
            raise ArgumentError(
                f"init_tag={init_tag} with n={n} gives tags outside int64; pass a smaller init_tag"
            )
        return (
            np.arange(init_tag, init_tag + n, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
        )
    if init_tag < 0:
        raise ArgumentError(
            f"init_tag must be >= 0 with pseudo_rand=True: numpy seeds are non-negative; "
            f"got init_tag={init_tag}, pass init_tag >= 0 or pseudo_rand=False"
        )
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    mapping = tag_map()
    first = (
        int(mapping[init_tag]) if init_tag <= MAX_TAG else int(int_generator_many([init_tag])[0])
    )
    if n == 1:
        return np.array([first], dtype=np.int64)
    nxt = mapping[1:].tolist()  # nxt[t] == _int_generator(t + 1) for t in 0..9999
    seen = [-1] * MAX_TAG
    walk: list[int] = []
    t = first
    while len(walk) < n and seen[t] < 0:
        seen[t] = len(walk)
        walk.append(t)
        t = nxt[t]
    if len(walk) == n:
        return np.array(walk, dtype=np.int64)
    start = seen[t]  # walk[start:] repeats forever
    out = np.empty(n, dtype=np.int64)
    out[: len(walk)] = walk
    out[len(walk) :] = np.resize(np.array(walk[start:], dtype=np.int64), n - len(walk))
    return out
