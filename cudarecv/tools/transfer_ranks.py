"""Timed transfers that run inside the ranks of a :class:`~cudarecv.testing.launch.Cluster` (2 ranks).

Shared by ``bench/bench_transfers.py`` and ``python -m cudarecv compare``. The
ranks time themselves: the parent's round trip through the cluster's queues is
far noisier than the transfers. :class:`VirtualClock` and :func:`replay` hand
those times to pytest-benchmark, so that its stats are the receiver's.

Rank 0 sends, rank 1 receives. Both build the same tensordict
deterministically (float32 leaves ``k0000``, ``k0001``, ..., one in ten of them
in a few nested tensordicts) and keep it between calls, so a workload is built
once per cluster. Each timed iteration starts with a barrier so that both ends
start together; the receiver measures from just before its receive call until
the data has landed (after ``wait`` for an asynchronous call), the sender its
send call. After the timed iterations, one more transfer checks the values: the
sender fills its leaves with a pattern stamped with a fresh number, the
receiver zeroes its own, receives and compares every byte.

A *case* is a dict::

    {"leaves": 2000, "leaf_bytes": 8192,        # or "total_bytes": 256 << 20
     "impl": "cudarecv", "mode": "buckets 1MiB",
     "iters": 5, "warmup": 1}

``leaf_bytes`` makes a plain tensordict of equal leaves (its consolidated twin is
built when a consolidated mode asks for it); ``total_bytes`` makes one
consolidated tensordict of ``leaves`` leaves totalling that many bytes, which
every mode of that workload uses. The modes, by ``impl``:

- ``stock`` (tensordict's own methods, called through
  ``cudarecv.p2p.stock.Stock`` so that ``cudarecv.install()``
  never changes them): ``per-leaf``, ``per-leaf pseudo_rand`` (``isend/irecv``),
  ``consolidated`` (``isend/irecv(consolidated=True)``);
- ``cudarecv``: the same three, plus ``buckets <N>`` (``bucket_bytes=N``) and
  ``chunks <N>`` (``consolidated=True, bucket_bytes=N``), through shared memory
  (the two ranks are cudarecv processes on one machine), and the same with
  ``wire`` after them (``transport="wire"``: the gloo socket); ``chunks <N> shared``
  sends a tensordict consolidated into shared memory
  (``consolidate(share_memory=True)``), which the receiver copies straight out of;
- ``raw`` torch.distributed: ``flat recv`` (``dist.send/recv`` of one uint8
  buffer of the payload's bytes), ``per-leaf dist.irecv``
  (``dist.isend/irecv`` of every leaf, tags 0, 1, ...) and ``buckets <N>``,
  hand-rolled bucketing: the sender packs every leaf into one buffer
  (``torch.cat``) and sends it in N-byte pieces, the receiver receives the
  pieces into one buffer and copies the leaves out (``torch._foreach_copy_``):
  the same bytes moved as cudarecv's buckets, without the header or any overlap.

``N`` is written ``256KiB``, ``1MiB``, ... or in bytes.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from ..testing.launch import RankError

SENDER, RECEIVER = 0, 1

MODES: dict[str, tuple[str, ...]] = {
    "stock": ("per-leaf", "per-leaf pseudo_rand", "consolidated"),
    "cudarecv": (
        "per-leaf",
        "per-leaf pseudo_rand",
        "consolidated",
        "buckets <N>",
        "chunks <N>",
        "buckets <N> wire",
        "chunks <N> wire",
        "chunks <N> shared",
    ),
    "raw": ("flat recv", "per-leaf dist.irecv", "buckets <N>"),
}

_SUFFIXES = (
    "wire",
    "shared",
)  # after ``buckets <N>``/``chunks <N>``: transport="wire"; a shared-memory storage
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}


# --------------------------------------------------------------------------- sizes and modes

#: what a mode does, once its size is taken off (``buckets``: cudarecv's fast wire, or raw bucketing)
Kind = Literal[
    "per-leaf",
    "per-leaf pseudo_rand",
    "consolidated",
    "buckets",
    "chunks",
    "flat recv",
    "per-leaf dist.irecv",
]


def parse_size(text: str | int) -> int:
    """``"1MiB"`` -> 1048576, ``"256KiB"`` -> 262144, ``"4096"`` -> 4096 (also kB/MB/GB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"not a size: {text!r}; write it like 1MiB, 256KiB or 4096")
        value = int(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """1048576 -> ``"1MiB"``, 262144 -> ``"256KiB"``, 1000 -> ``"1000B"`` (binary units, exact only)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def parse_mode(impl: str, mode: str) -> tuple[Kind, int | None]:
    """Check ``impl``/``mode``; return (mode kind, bucket bytes or None).

    Kinds: ``per-leaf``, ``per-leaf pseudo_rand``, ``consolidated``, ``buckets``,
    ``chunks``, ``flat recv``, ``per-leaf dist.irecv`` (``buckets`` is cudarecv's or raw).
    """
    if impl not in MODES:
        raise ValueError(f"unknown impl {impl!r}; pick one of {sorted(MODES)}")
    words = mode.split()
    suffix = words[2] if len(words) == 3 and words[2] in _SUFFIXES else ""
    if len(words) in (2, 3) and words[0] in ("buckets", "chunks") and (len(words) == 2 or suffix):
        kind, bucket_bytes = words[0], parse_size(words[1])
    else:
        kind, bucket_bytes = " ".join(words), None
    allowed = [
        m.replace(" <N>", "").removesuffix(f" {suffix}")
        for m in MODES[impl]
        if (m.split()[-1] if m.split()[-1] in _SUFFIXES else "") == suffix
    ]
    if kind not in allowed or (bucket_bytes is None and kind in ("buckets", "chunks")):
        raise ValueError(
            f"unknown mode {mode!r} for impl {impl!r}; pick one of {list(MODES[impl])}"
        )
    return cast(Kind, kind), bucket_bytes  # (one of MODES[impl]'s, checked)


def mode_options(kind: Kind, bucket_bytes: int | None, mode: str = "") -> dict:
    """cudarecv/stock keyword arguments of a mode kind (and bucket bytes) from :func:`parse_mode`
    (``mode``: the mode's name, whose ``wire`` suffix forces the wire)."""
    out: dict[str, Any] = {}
    if mode.endswith(" wire"):
        out["transport"] = "wire"
    if kind == "per-leaf pseudo_rand":
        out["pseudo_rand"] = True
    if kind in ("consolidated", "chunks"):
        out["consolidated"] = True
    if bucket_bytes is not None:
        out["bucket_bytes"] = bucket_bytes
    return out


def check_case(case: dict) -> None:
    """Raise ValueError (in the parent, before anything runs) if ``case`` is malformed."""
    parse_mode(case["impl"], case["mode"])
    leaves = case.get("leaves")
    if not isinstance(leaves, int) or leaves <= 0:
        raise ValueError(f"`leaves` must be a positive int, got {leaves!r}")
    if ("leaf_bytes" in case) == ("total_bytes" in case):
        raise ValueError(
            "give exactly one of `leaf_bytes` (plain tensordict) and `total_bytes` (consolidated)"
        )
    size = case.get("leaf_bytes") or case.get("total_bytes")
    if not isinstance(size, int) or size <= 0 or size % 4:
        raise ValueError(
            f"byte counts must be positive multiples of 4 (float32 leaves), got {size!r}"
        )
    if "total_bytes" in case and case["total_bytes"] // 4 < leaves:
        raise ValueError(
            f"{case['total_bytes']} bytes cannot hold {leaves} non-empty float32 leaves"
        )
    for key in ("iters", "warmup"):
        value = case.get(key, 1)
        if not isinstance(value, int) or value < (1 if key == "iters" else 0):
            raise ValueError(
                f"`{key}` must be an int >= {1 if key == 'iters' else 0}, got {value!r}"
            )


def payload_bytes(case: dict) -> int:
    """The bytes of the leaves of the case's tensordict (what GB/s counts)."""
    return case["total_bytes"] if "total_bytes" in case else case["leaves"] * case["leaf_bytes"]


def leaf_modes(bucket: str) -> list[tuple[str, str, str | None]]:
    """(impl, mode, stock_mode) of the many-leaves case; the first raw row is the flat buffer."""
    return [
        ("stock", "per-leaf", None),
        ("stock", "per-leaf pseudo_rand", None),
        ("stock", "consolidated", None),
        ("raw", "flat recv", None),
        ("raw", "per-leaf dist.irecv", "per-leaf"),
        ("raw", f"buckets {bucket}", "per-leaf"),
        ("cudarecv", "per-leaf", None),
        ("cudarecv", "per-leaf pseudo_rand", None),
        ("cudarecv", "consolidated", None),
        ("cudarecv", f"buckets {bucket}", "per-leaf"),
        ("cudarecv", f"chunks {bucket}", "consolidated"),
        ("cudarecv", f"chunks {bucket} shared", "consolidated"),
        ("cudarecv", f"buckets {bucket} wire", "per-leaf"),
        ("cudarecv", f"chunks {bucket} wire", "consolidated"),
    ]


def consolidated_modes(bucket: str) -> list[tuple[str, str, str | None]]:
    """(impl, mode, stock_mode) of the consolidated case."""
    return [
        ("stock", "consolidated", None),
        ("raw", "flat recv", "consolidated"),
        ("cudarecv", "consolidated", None),
        ("cudarecv", f"chunks {bucket}", "consolidated"),
        ("cudarecv", f"chunks {bucket} wire", "consolidated"),
        ("cudarecv", f"chunks {bucket} shared", "consolidated"),
        ("stock", "per-leaf", None),
        ("cudarecv", "per-leaf", None),
    ]


# --------------------------------------------------------------------------- workloads (in the ranks)


@dataclass
class Workload:
    """The tensordicts and buffers of one workload on one rank."""

    key: tuple
    plain: Any  # a TensorDict whose leaves are separate tensors, or None
    cons: Any  # a consolidated TensorDict, built on demand for a plain workload
    nbytes: int
    base: torch.Tensor  # float32 pattern, (arange % 251), as long as the longest leaf
    _flat: torch.Tensor | None = None
    _cons_shared: Any = None
    _flat_base: torch.Tensor | None = None

    def consolidated(self) -> Any:
        if self.cons is None:
            self.cons = self.plain.consolidate(metadata=True)
        return self.cons

    def consolidated_shared(self) -> Any:
        """The tensordict consolidated into shared memory (``consolidate(share_memory=True)``), apart from
        :meth:`consolidated` (moving that one would change every other mode)."""
        if self._cons_shared is None:
            self._cons_shared = (
                self.per_leaf().contiguous().consolidate(metadata=True, share_memory=True)
            )
        return self._cons_shared

    def per_leaf(self) -> Any:
        return self.plain if self.plain is not None else self.cons

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = torch.zeros(self.nbytes, dtype=torch.uint8)
        return self._flat

    def flat_base(self) -> torch.Tensor:
        if self._flat_base is None:
            period = torch.arange(251, dtype=torch.uint8)
            self._flat_base = period.repeat(self.nbytes // 251 + 1)[: self.nbytes].clone()
        return self._flat_base


class KeptWorkload:
    """A rank's one workload, kept until a case of another size asks for another.

    The old workload is dropped and collected (with cudarecv's plans of it)
    before the new one is built, so that two never take memory at once.
    """

    def __init__(self) -> None:
        self.value: Any = None

    def get(self, case: dict, build: Callable[[tuple, dict], Any]) -> Any:
        """The kept workload if it is ``case``'s, else ``build(key, case)``'s, kept in its stead."""
        key = (case["leaves"], case.get("leaf_bytes"), case.get("total_bytes"))
        if self.value is not None and self.value.key == key:
            return self.value
        self.drop()  # free the previous workload (and cudarecv's plans of it) first
        self.value = build(key, case)
        return self.value

    def drop(self) -> None:
        """Free the kept workload (and cudarecv's plans of it)."""
        self.value = None
        gc.collect()


_WORKLOAD = KeptWorkload()
_STAMP = 0


def leaf_sizes(case: dict) -> list[int]:
    """float32 element counts of the leaves."""
    n = case["leaves"]
    if "leaf_bytes" in case:
        return [case["leaf_bytes"] // 4] * n
    total = case["total_bytes"] // 4
    q, r = divmod(total, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def build_tensordict(case: dict) -> Any:
    """The case's tensordict (zeros): leaves ``k0000``..., every tenth in nested ``n0``/``n1``/``n2``."""
    from tensordict import TensorDict

    top: dict[str, Any] = {}
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for i, numel in enumerate(leaf_sizes(case)):
        shape = (numel // 16, 16) if i % 2 and numel % 16 == 0 else (numel,)
        t = torch.zeros(shape, dtype=torch.float32)
        if i % 10 == 9:
            nested.setdefault(f"n{(i // 10) % 3}", {})[f"k{i:04d}"] = t
        else:
            top[f"k{i:04d}"] = t
    for name, leaves in nested.items():
        top[name] = TensorDict(leaves, batch_size=[])
    return TensorDict(top, batch_size=[])


def _build_workload(key: tuple, case: dict) -> Workload:
    td = build_tensordict(case)
    base = (torch.arange(max(leaf_sizes(case))) % 251).to(torch.float32)
    if "total_bytes" in case:
        return Workload(key, None, td.consolidate(metadata=True), payload_bytes(case), base)
    return Workload(key, td, None, payload_bytes(case), base)


def workload(case: dict) -> Workload:
    """This rank's workload for ``case``, built once and kept until another is asked for."""
    return _WORKLOAD.get(case, _build_workload)


def drop_workload(rank: int, world_size: int, group: Any) -> None:
    """Free this rank's kept workload (run in the ranks when the next bench moves other tensors)."""
    _WORKLOAD.drop()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for untimed work (fills, checks): where the ranks share few cores, each
    parallel op otherwise waits for torch's other threads to be scheduled (a 100 MB fill took 1 s,
    not 10 ms, under load on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def leaves_of(td: Any) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


# --------------------------------------------------------------------------- one mode


@dataclass
class Op:
    """What each end calls for one mode, and the memory it moves (for the check)."""

    send: Callable[[], Any]
    recv: Callable[[], Any]
    leaves: list[torch.Tensor] = field(default_factory=list)  # float32 leaves, or
    flat: torch.Tensor | None = None  # one uint8 buffer
    base: torch.Tensor | None = None  # the check's pattern: float32 for leaves, uint8 for flat
    transport: list[str] = field(
        default_factory=lambda: ["wire"]
    )  # what carried the last receive (cudarecv)


def peers(group: Any) -> tuple[dict, dict]:
    if group is None:
        return {"dst": RECEIVER}, {"src": SENDER}
    return {"group": group, "group_dst": RECEIVER}, {"group": group, "group_src": SENDER}


def make_op(case: dict, group: Any) -> Op:
    """The send and receive calls of ``case`` on this rank's workload."""
    import cudarecv

    from ..p2p.stock import STOCK_CONSOLIDATED_ISEND, Stock

    kind, bucket_bytes = parse_mode(case["impl"], case["mode"])
    impl, w = case["impl"], workload(case)
    to, frm = peers(group)

    if impl == "raw" and kind == "flat recv":
        buf = w.flat()
        if group is None:
            return Op(
                lambda: dist.send(buf, dst=RECEIVER),
                lambda: dist.recv(buf, src=SENDER),
                flat=buf,
                base=w.flat_base(),
            )
        return Op(
            lambda: group.send([buf], RECEIVER, 0).wait(),
            lambda: group.recv([buf], SENDER, 0).wait(),
            flat=buf,
            base=w.flat_base(),
        )

    if case["mode"].endswith(" shared"):
        td = w.consolidated_shared()
    else:
        td = w.consolidated() if kind in ("consolidated", "chunks") else w.per_leaf()
    leaves = leaves_of(td)
    if impl == "raw" and kind == "buckets" and bucket_bytes is not None:
        return _raw_buckets(leaves, bucket_bytes, group, w.base)
    if impl == "raw":  # per-leaf dist.irecv
        post = _raw_poster(group)

        def raw_send() -> None:
            for work in [post(True, t, i) for i, t in enumerate(leaves)]:
                work.wait()

        def raw_recv() -> None:
            for work in [post(False, t, i) for i, t in enumerate(leaves)]:
                work.wait()

        return Op(raw_send, raw_recv, leaves, base=w.base)

    options = mode_options(kind, bucket_bytes, case["mode"])
    if impl == "stock":  # tensordict 0.14 has consolidated= on send/recv only: the same one message
        stock_send, stock_recv = (
            (Stock.isend, Stock.irecv)
            if STOCK_CONSOLIDATED_ISEND or not options.get("consolidated")
            else (Stock.send, Stock.recv)
        )
        return Op(
            lambda: stock_send(td, **to, **options),
            lambda: stock_recv(td, **frm, **options),
            leaves,
            base=w.base,
        )
    carried = ["wire"]  # what carried the last receive

    def receive() -> None:
        for transfer in cudarecv.irecv(td, **frm, **options, return_premature=True):
            transfer.wait()
            carried[0] = transfer.transport

    return Op(
        lambda: cudarecv.isend(td, **to, **options), receive, leaves, base=w.base, transport=carried
    )


def _raw_poster(group: Any) -> Callable[[bool, torch.Tensor, int], Any]:
    """``post(sending, tensor, tag)``: one raw send to / receive from the peer, on ``group`` or the default group."""

    def post(sending: bool, t: torch.Tensor, tag: int) -> Any:
        if group is None:
            return (
                dist.isend(t, dst=RECEIVER, tag=tag)
                if sending
                else dist.irecv(t, src=SENDER, tag=tag)
            )
        return group.send([t], RECEIVER, tag) if sending else group.recv([t], SENDER, tag)

    return post


def _raw_buckets(
    leaves: list[torch.Tensor], bucket_bytes: int, group: Any, base: torch.Tensor
) -> Op:
    """Hand-rolled bucketing with torch.distributed (see the module docstring)."""
    views = [t.reshape(-1).view(torch.uint8) for t in leaves]
    staging = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
    pieces = list(staging.split(bucket_bytes))
    parts = list(staging.split([v.numel() for v in views]))
    post = _raw_poster(group)

    def send() -> None:
        torch.cat(views, out=staging)
        for work in [post(True, p, i) for i, p in enumerate(pieces)]:
            work.wait()

    def recv() -> None:
        for work in [post(False, p, i) for i, p in enumerate(pieces)]:
            work.wait()
        torch._foreach_copy_(views, parts)

    return Op(send, recv, leaves, base=base)


def sync(group: Any) -> None:
    if group is None:
        dist.barrier()
    else:
        group.barrier().wait()


def _process_cpu() -> float:
    """CPU seconds of this process so far, every thread (gloo's socket threads too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(rank: int, op: Op, count: int, group: Any, cpu: list[float] | None = None) -> list[float]:
    """``count`` iterations; this rank's seconds for each (and, into ``cpu``, its process CPU seconds)."""
    call = op.recv if rank == RECEIVER else op.send
    out = []
    clock = time.perf_counter
    for _ in range(count):
        sync(group)
        c0 = _process_cpu()
        t0 = clock()
        call()
        out.append(clock() - t0)
        if cpu is not None:
            cpu.append(_process_cpu() - c0)
    return out


def _fill(op: Op, stamp: int, zero: bool) -> None:
    base = op.base
    assert base is not None  # (every op has its pattern)
    if op.flat is not None:
        if zero:
            op.flat.zero_()
        else:
            torch.add(base, stamp % 256, out=op.flat)
        return
    for i, t in enumerate(op.leaves):
        flat = t.view(-1)
        if zero:
            flat.zero_()
        else:
            torch.add(base[: flat.numel()], float(256 * ((i + stamp) % 4096)), out=flat)


def _mismatch(op: Op, stamp: int) -> str | None:
    """None if the receiver holds the pattern stamped ``stamp``, else what differs."""
    base = op.base
    assert base is not None  # (every op has its pattern)
    if op.flat is not None:
        expected = torch.add(base, stamp % 256)
        if torch.equal(op.flat, expected):
            return None
        bad = int((op.flat != expected).nonzero()[0, 0])
        return (
            f"flat buffer differs from byte {bad} on ({int(op.flat[bad])} != {int(expected[bad])})"
        )
    for i, t in enumerate(op.leaves):
        flat = t.view(-1)
        expected = torch.add(base[: flat.numel()], float(256 * ((i + stamp) % 4096)))
        if not torch.equal(flat, expected):
            bad = int((flat != expected).nonzero()[0, 0])
            return (
                f"leaf {i} of {len(op.leaves)} differs at element {bad} "
                f"({float(flat[bad])} != {float(expected[bad])})"
            )
    return None


def verify(rank: int, op: Op, group: Any) -> str | None:
    """One checked transfer; the receiver returns None or what was wrong."""
    global _STAMP
    _STAMP += 1  # both ranks run the same calls, so their stamps agree
    with one_thread():
        _fill(op, _STAMP, zero=rank == RECEIVER)
    timed(rank, op, 1, group)
    if rank != RECEIVER:
        return None
    with one_thread():
        problem = _mismatch(op, _STAMP)
        _fill(op, 0, zero=True)
    return problem


# --------------------------------------------------------------------------- entry points (run in the ranks)


def time_case(rank: int, world_size: int, group: Any, case: dict) -> dict:
    """Run one case: ``warmup`` + ``iters`` timed iterations, then one checked transfer.

    Returns, on each rank, ``{"rank", "seconds": [per timed iteration], "ok", "error"}``;
    the receiver's (rank 1) seconds are the ones to report, ``ok``/``error`` are
    set by the receiver only (the sender's are always ``True``/``None``).
    """
    return time_suite(rank, world_size, group, [case], rounds=1)[0]


def time_suite(
    rank: int,
    world_size: int,
    group: Any,
    cases: Sequence[dict],
    rounds: int = 1,
    op_for: Callable[[dict], Op] | None = None,
) -> list[dict]:
    """Run several cases of one workload side by side, to beat noise (the one suite timer).

    Each case first runs its ``warmup`` iterations; then ``rounds`` rounds each
    run ``iters`` timed iterations of every case, the order rotated by one case
    per round (so no case always follows the same one); then each case is
    checked once. Returns one dict per case, as :func:`time_case` does, with the
    times of all rounds. ``op_for(case)`` builds a case's :class:`Op` (default:
    :func:`make_op` on this group; the GPU benches pass theirs).
    """
    if world_size != 2:
        raise ValueError(f"transfer timings need exactly 2 ranks, got {world_size}")
    if len({(c["leaves"], c.get("leaf_bytes"), c.get("total_bytes")) for c in cases}) > 1:
        raise ValueError(
            "the cases of one suite must share their workload (leaves, leaf_bytes/total_bytes)"
        )
    ops = [op_for(case) if op_for is not None else make_op(case, group) for case in cases]
    times: list[list[float]] = [[] for _ in cases]
    cpu: list[list[float]] = [[] for _ in cases]
    for op, case in zip(ops, cases):
        timed(rank, op, case.get("warmup", 1), group)
    n = len(cases)
    for r in range(rounds):
        for j in [(r + k) % n for k in range(n)]:
            times[j] += timed(rank, ops[j], cases[j].get("iters", 1), group, cpu[j])
    out = []
    for op, t, c in zip(ops, times, cpu):
        problem = verify(rank, op, group)
        out.append(
            {
                "rank": rank,
                "seconds": t,
                "cpu_seconds": c,
                "ok": problem is None,
                "error": problem,
                "transport": op.transport[0],
            }
        )
    return out


# --------------------------------------------------------------------------- parent side


def summarize(case: dict, per_rank: Sequence[dict]) -> dict:
    """Merge the two ranks' results of one case into what the reports need.

    Returns ``case`` plus ``bytes``, ``seconds`` (median of the receiver's
    iterations), ``seconds_min``, ``seconds_all``, ``send_seconds`` (the
    sender's median), ``ok`` and ``error``; with per-iteration process CPU
    times (:func:`time_suite`), ``cpu_seconds`` and ``send_cpu_seconds``, the
    receiver's and the sender's medians (all threads of each process).
    """
    recv, send = per_rank[RECEIVER], per_rank[SENDER]
    times = sorted(recv["seconds"])
    row = {
        **case,
        "bytes": payload_bytes(case),
        "seconds": median(times),
        "seconds_min": times[0],
        "seconds_all": list(recv["seconds"]),
        "send_seconds": median(sorted(send["seconds"])),
        "ok": bool(recv["ok"]),
        "error": recv["error"],
        "transport": recv.get("transport", "wire"),
    }
    if recv.get("cpu_seconds") and send.get("cpu_seconds"):
        row["cpu_seconds"] = median(sorted(recv["cpu_seconds"]))
        row["send_cpu_seconds"] = median(sorted(send["cpu_seconds"]))
    return row


def run_suite_once(
    ranks: Any,
    name: str,
    targets: list[str],
    *,
    rank_fn: Callable[..., list[dict]],
    cases: Callable[[str], list[dict]],
    rounds: int,
    row_mode: Callable[[dict], str],
    target_lines: Callable[[str, dict], list[str]],
    results: dict,
    errors: dict,
    what: str = "case",
) -> dict[tuple[str, str], dict]:
    """The rows of the bench suite ``name``, keyed by (impl, ``row_mode(case)``): run once per session.

    The first call runs all of ``cases(name)`` interleaved in ``ranks.get()``'s ranks
    (``rank_fn(cases, rounds)``, e.g. :func:`time_suite`), keeps the rows in
    ``results`` (each with ``suite_seconds``, the parent's wall time of that call)
    and adds ``target_lines(name, rows)`` to ``targets``; later calls return the
    kept rows. A rank failure is kept in ``errors``, and later calls raise it again.
    """
    if name in errors:
        raise RuntimeError(f"{what} {name!r} failed earlier in this session:\n{errors[name]}")
    if name not in results:
        todo = cases(name)
        t0 = time.perf_counter()
        try:
            per_rank = ranks.get().run(rank_fn, args=(todo, rounds), timeout=540)
        except RankError as error:
            errors[name] = str(error)
            raise
        wall = time.perf_counter() - t0
        rows = {}
        for i, case in enumerate(todo):
            row = summarize(case, [per_rank[0][i], per_rank[1][i]])
            row["suite_seconds"] = wall
            rows[(case["impl"], row_mode(case))] = row
        results[name] = rows
        targets.extend(target_lines(name, rows))
    return results[name]


# --------------------------------------------------------------------------- pytest-benchmark (parent side)


class VirtualClock:
    """A pytest-benchmark timer whose value only moves when told: ``clock.advance(seconds)``.

    The benches measure inside the ranks (or a child process), where the
    parent's round trip cannot add its noise; this clock hands those times to
    pytest-benchmark. Mark a bench ``@pytest.mark.benchmark(timer=clock)`` and
    call :func:`replay`: in pedantic mode pytest-benchmark reads its timer only
    just before and just after each call of the target, so each round lasts
    exactly the seconds that call advanced the clock, and the table it prints,
    its JSON ``stats`` (``data``, ``min``, ``median``, ``mean``, ``rounds``...)
    and ``--benchmark-compare`` are the measured times.
    """

    def __init__(self, name: str = "virtual_clock") -> None:
        self.__name__ = name  # pytest-benchmark writes it as the JSON's options.timer
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def restart(self) -> None:
        """Back to 0.0: the next round then lasts ``seconds - 0.0 == seconds``, no rounding from a running sum."""
        self.now = 0.0

    def __repr__(self) -> str:
        return f"VirtualClock({self.__name__!r})"


def replay(benchmark: Any, clock: VirtualClock, seconds: Sequence[float]) -> None:
    """Record ``seconds`` (one measured iteration each) as ``benchmark``'s rounds, exactly.

    ``benchmark`` must be timed by ``clock`` (``@pytest.mark.benchmark(timer=clock)``):
    with pytest-benchmark's default clock the rounds would time the replay itself.
    """
    times = [float(s) for s in seconds]
    if not times or not all(math.isfinite(t) and t >= 0 for t in times):
        raise ValueError(f"replay needs finite, non-negative times, got {times!r}")
    timer = getattr(benchmark, "_timer", clock)  # pytest-benchmark's fixture keeps its timer there
    if timer is not clock:
        raise RuntimeError(
            f"{getattr(benchmark, 'name', 'this bench')} is timed by {timer!r}, not by {clock!r}: "
            "mark it @pytest.mark.benchmark(timer=clock)"
        )
    pending = iter(times)
    # after the rounds, --benchmark-cprofile calls the target again (profiled, not timed): 0.0 then
    benchmark.pedantic(
        lambda: clock.advance(next(pending, 0.0)),
        setup=clock.restart,
        rounds=len(times),
        iterations=1,
    )


def median(sorted_values: list[float]) -> float:
    """The median of an already sorted, non-empty list."""
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2
