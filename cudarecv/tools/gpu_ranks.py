"""Timed GPU transfers inside the ranks of a :class:`~cudarecv.testing.launch.Cluster` (2 ranks).

Used by ``bench/bench_gpu.py``. Built on :mod:`cudarecv.tools.transfer_ranks`: the
same case dicts (``leaves``, ``leaf_bytes`` or ``total_bytes``, ``impl``,
``mode``, ``iters``, ``warmup``), the same modes and tensordicts, the same
timing (a barrier, then each rank times its own call with ``perf_counter``),
the same side-by-side rounds and the same checked transfer after them. Added
here:

- where each end keeps its tensordict: ``send_place`` and ``recv_place``, each
  ``"cpu"``, ``"pinned"`` (page-locked host memory; for a consolidated mode the
  storage is pinned) or ``"cuda"`` (the rank's current GPU). A call that
  touches a GPU ends with ``torch.cuda.synchronize()`` inside the timed region,
  so the time covers the bytes landing, not just the call returning;
- :func:`matmul_interference`: how much a matmul loop on the default stream
  slows down while a large receive lands on cudarecv's dedicated stream.

Rank 0 sends, rank 1 receives. Rows are labelled with :func:`label`, e.g.
``"chunks 4MiB cpu->cuda"`` (the mode, then sender and receiver places).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import transfer_ranks as tb

SENDER, RECEIVER = tb.SENDER, tb.RECEIVER
PLACES = ("cpu", "pinned", "cuda")


# --------------------------------------------------------------------------- cases (parent side)


def places(case: dict) -> tuple[str, str]:
    """(send place, receive place) of ``case``; both default to ``"cpu"``."""
    return case.get("send_place", "cpu"), case.get("recv_place", "cpu")


def label(case: dict) -> str:
    """The report's mode of ``case``: ``"<mode> <send place>-><receive place>"``."""
    send, recv = places(case)
    return f"{case['mode']} {send}->{recv}"


def check_gpu_case(case: dict, backend: str) -> None:
    """Raise ValueError (in the parent, before anything runs) for a case that cannot run on ``backend``."""
    tb.check_case(case)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    for where in places(case):
        if where not in PLACES:
            raise ValueError(f"a place must be one of {PLACES}, got {where!r}")
    if case["impl"] in ("stock", "raw"):
        gpu = [p == "cuda" for p in places(case)]
        if backend == "gloo" and any(gpu):
            raise ValueError(
                f"{case['impl']} {case['mode']!r}: gloo carries host memory only; "
                "use cpu or pinned places (cudarecv stages CUDA memory itself)"
            )
        if backend == "nccl" and not all(gpu):
            raise ValueError(
                f"{case['impl']} {case['mode']!r}: NCCL carries CUDA memory only; "
                "use cuda places (cudarecv stages host memory itself)"
            )


# --------------------------------------------------------------------------- workloads (in the ranks)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@dataclass
class GpuWorkload:
    """One rank's tensordicts and buffers of one workload, per place, built on first use."""

    key: tuple
    case: dict
    nbytes: int
    _plain: dict = field(default_factory=dict)
    _cons: dict = field(default_factory=dict)
    _flat: dict = field(default_factory=dict)
    _base: dict = field(default_factory=dict)
    _flat_base: dict = field(default_factory=dict)

    def td(self, place: str, consolidated: bool) -> Any:
        """The workload's tensordict on ``place`` (consolidated: its storage there)."""
        cache = self._cons if consolidated else self._plain
        if place not in cache:
            built = tb.build_tensordict(self.case)
            if consolidated:
                if place == "cuda":
                    td = built.consolidate(metadata=True, device=_device())
                elif place == "pinned":
                    td = built.consolidate(metadata=True, pin_memory=True)
                else:
                    td = built.consolidate(metadata=True)
            else:
                td = (
                    built.to(_device())
                    if place == "cuda"
                    else built.pin_memory()
                    if place == "pinned"
                    else built
                )
            del built
            cache[place] = td
        return cache[place]

    def flat(self, place: str) -> torch.Tensor:
        """One uint8 buffer of the payload's bytes on ``place``."""
        if place not in self._flat:
            if place == "cuda":
                self._flat[place] = torch.zeros(self.nbytes, dtype=torch.uint8, device=_device())
            else:
                self._flat[place] = torch.zeros(
                    self.nbytes, dtype=torch.uint8, pin_memory=place == "pinned"
                )
        return self._flat[place]

    def base(self, device: torch.device) -> torch.Tensor:
        """The check's float32 pattern on ``device`` (as long as the longest leaf)."""
        key = str(device)
        if key not in self._base:
            self._base[key] = (
                (torch.arange(max(tb.leaf_sizes(self.case))) % 251).to(torch.float32).to(device)
            )
        return self._base[key]

    def flat_base(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._flat_base:
            period = torch.arange(251, dtype=torch.uint8)
            self._flat_base[key] = (
                period.repeat(self.nbytes // 251 + 1)[: self.nbytes].clone().to(device)
            )
        return self._flat_base[key]


_WORKLOAD = tb.KeptWorkload()


def _build_workload(key: tuple, case: dict) -> GpuWorkload:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return GpuWorkload(
        key,
        {k: case[k] for k in ("leaves", "leaf_bytes", "total_bytes") if k in case},
        tb.payload_bytes(case),
    )


def workload(case: dict) -> GpuWorkload:
    """This rank's workload for ``case``, kept until another is asked for."""
    return _WORKLOAD.get(case, _build_workload)


def _backend(group: Any) -> str:
    return str(group.name()).lower() if group is not None else str(dist.get_backend()).lower()


def _landed() -> None:
    torch.cuda.synchronize()


def _nothing() -> None:
    pass


def make_op(rank: int, case: dict, group: Any) -> tb.Op:
    """This rank's call of ``case`` (see :class:`cudarecv.tools.transfer_ranks.Op`), on its place."""
    import cudarecv

    from ..p2p.stock import Stock

    kind, bucket_bytes = tb.parse_mode(case["impl"], case["mode"])
    send_place, recv_place = places(case)
    place = recv_place if rank == RECEIVER else send_place
    gpu = place == "cuda" or _backend(group) == "nccl"
    land = _landed if gpu else _nothing
    w = workload(case)
    to, frm = tb.peers(group)

    if case["impl"] == "raw" and kind == "flat recv":
        buf = w.flat(place)
        base = w.flat_base(buf.device)
        if group is None:

            def send() -> None:
                dist.send(buf, dst=RECEIVER)
                land()

            def recv() -> None:
                dist.recv(buf, src=SENDER)
                land()
        else:

            def send() -> None:
                group.send([buf], RECEIVER, 0).wait()
                land()

            def recv() -> None:
                group.recv([buf], SENDER, 0).wait()
                land()

        return tb.Op(send, recv, flat=buf, base=base)

    td = w.td(place, kind in ("consolidated", "chunks"))
    leaves = tb.leaves_of(td)
    base = w.base(leaves[0].device)
    if case["impl"] == "raw":  # per-leaf dist.irecv
        if group is None:

            def send() -> None:
                for work in [dist.isend(t, dst=RECEIVER, tag=i) for i, t in enumerate(leaves)]:
                    assert work is not None  # (None only off the group)
                    work.wait()
                land()

            def recv() -> None:
                for work in [dist.irecv(t, src=SENDER, tag=i) for i, t in enumerate(leaves)]:
                    assert work is not None  # (None only off the group)
                    work.wait()
                land()
        else:

            def send() -> None:
                for work in [group.send([t], RECEIVER, i) for i, t in enumerate(leaves)]:
                    work.wait()
                land()

            def recv() -> None:
                for work in [group.recv([t], SENDER, i) for i, t in enumerate(leaves)]:
                    work.wait()
                land()

        return tb.Op(send, recv, leaves, base=base)

    opts = tb.mode_options(kind, bucket_bytes, case["mode"])
    impl = Stock if case["impl"] == "stock" else cudarecv

    carried = [
        "wire"
    ]  # what carried the last receive (what a row's label claims is checked against it)

    def send_td() -> None:
        impl.isend(td, **to, **opts)
        land()

    def recv_td() -> None:
        if impl is Stock:
            impl.irecv(td, **frm, **opts)
        else:
            for transfer in cudarecv.irecv(td, **frm, **opts, return_premature=True):
                transfer.wait()
                carried[0] = transfer.transport
        land()

    return tb.Op(send_td, recv_td, leaves, base=base, transport=carried)


# --------------------------------------------------------------------------- entry points (in the ranks)


def time_gpu_suite(
    rank: int, world_size: int, group: Any, cases: Sequence[dict], rounds: int = 1
) -> list[dict]:
    """:func:`cudarecv.tools.transfer_ranks.time_suite` with each case on its place (CPU, pinned, GPU)."""
    return tb.time_suite(
        rank, world_size, group, cases, rounds, op_for=lambda case: make_op(rank, case, group)
    )


def matmul_interference(rank: int, world_size: int, group: Any, cfg: dict) -> dict:
    """A matmul loop on the receiver's default stream, alone and while a receive lands.

    ``cfg``: ``leaves``, ``total_bytes``, ``mode`` (a cudarecv mode, e.g.
    ``"chunks 4MiB"``), ``send_place``, ``recv_place``, ``rounds``, ``n`` (the
    square matrices' size), ``dtype``, ``fill`` (the loop is sized to this
    fraction of a receive's time, so that it runs entirely during the receive),
    ``max_matmuls``. Rounds alternate (alone, during) and (during, alone).

    Returns on the receiver: ``alone``/``during`` (the loop's GPU seconds, CUDA
    events), ``recv_alone``/``recv_during`` (the receive's seconds, until the
    bytes landed), ``matmuls`` (the loop's length), ``matmul_seconds`` (one
    matmul), ``ok``/``error`` (a checked transfer at the end).
    """
    import cudarecv

    case = {
        "leaves": cfg["leaves"],
        "total_bytes": cfg["total_bytes"],
        "impl": "cudarecv",
        "mode": cfg["mode"],
        "send_place": cfg["send_place"],
        "recv_place": cfg["recv_place"],
        "iters": 1,
        "warmup": 1,
    }
    kind, bucket_bytes = tb.parse_mode("cudarecv", cfg["mode"])
    opts = tb.mode_options(kind, bucket_bytes, cfg["mode"])
    op = make_op(rank, case, group)
    td = workload(case).td(
        cfg["recv_place"] if rank == RECEIVER else cfg["send_place"],
        kind in ("consolidated", "chunks"),
    )
    _, frm = tb.peers(group)
    tb.timed(rank, op, 1, group)  # warm-up: plans, staging, streams, communicators
    recv_alone = tb.timed(rank, op, 3, group)

    out: dict[str, Any] = {
        "rank": rank,
        "alone": [],
        "during": [],
        "recv_alone": list(recv_alone),
        "recv_during": [],
    }
    if rank == RECEIVER:
        dtype = getattr(torch, cfg.get("dtype", "bfloat16"))
        n = cfg.get("n", 8192)
        a = torch.randn(n, n, device=_device(), dtype=dtype)
        b = torch.randn(n, n, device=_device(), dtype=dtype)
        c = torch.empty(n, n, device=_device(), dtype=dtype)

        def loop(count: int) -> tuple[Any, Any]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                torch.matmul(a, b, out=c)
            end.record()
            return start, end

        for _ in range(3):
            torch.matmul(a, b, out=c)
        start, end = loop(20)
        end.synchronize()
        per_matmul = start.elapsed_time(end) / 1e3 / 20
        target = cfg.get("fill", 0.8) * tb.median(sorted(recv_alone))
        count = int(min(cfg.get("max_matmuls", 800), max(10, target / per_matmul)))
        out["matmuls"], out["matmul_seconds"] = count, per_matmul

    for r in range(cfg.get("rounds", 6)):
        for what in ("alone", "during") if r % 2 == 0 else ("during", "alone"):
            tb.sync(group)
            if rank == SENDER:
                if what == "during":
                    op.send()
                continue
            torch.cuda.synchronize()
            if what == "alone":
                start, end = loop(count)
                end.synchronize()
                out["alone"].append(start.elapsed_time(end) / 1e3)
                continue
            t0 = time.perf_counter()
            [transfer] = cudarecv.irecv(td, **frm, return_premature=True, **opts)
            start, end = loop(count)  # queued on the default stream while the receive lands
            transfer.wait()
            torch.cuda.synchronize()
            out["recv_during"].append(time.perf_counter() - t0)
            out["during"].append(start.elapsed_time(end) / 1e3)
    problem = tb.verify(rank, op, group)
    out["ok"], out["error"] = problem is None, problem
    return out


def fanout_on_gpu(rank: int, world_size: int, group: Any, total_bytes: int, rounds: int) -> dict:
    """Rank 0 gets its GPU weights to ranks 1..N-1 (their GPUs) by relay, by star, and by NCCL's
    ``dist.broadcast`` of one flat buffer; each round from a barrier until the last receiver holds
    the bytes (its stream synchronized). Rank 0 returns ``{method: [seconds per round]}`` and checks."""
    import cudarecv

    device = _device()
    weights = {"w": torch.zeros(total_bytes // 4, device=device)}
    from tensordict import TensorDict

    td = TensorDict(weights, batch_size=[])
    flat = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
    dsts = list(range(1, world_size))
    seconds: dict[str, list[float]] = {m: [] for m in ("relay", "star", "broadcast")}
    ok: dict[str, bool] = {}
    for method in seconds:
        sender: cudarecv.WeightSender | None = None
        receiver: cudarecv.WeightReceiver | None = None
        if method != "broadcast":
            if rank == 0:
                sender = cudarecv.WeightSender(
                    td,
                    dst=dsts,
                    fanout="relay" if method == "relay" else "star",
                    bucket_bytes=4 << 20,
                    timeout=120,
                )
            else:
                receiver = cudarecv.WeightReceiver(src=0, device=device, timeout=120)
        for step in range(1, rounds + 1):
            if rank == 0:
                td["w"].fill_(float(step))
                flat.fill_(step % 256)
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            if method == "broadcast":
                dist.broadcast(flat, src=0)
            elif sender is not None:
                sender.push()
            else:
                assert receiver is not None  # (rank > 0)
                receiver.pull()
            torch.cuda.synchronize()
            stamp = torch.tensor(
                [start if rank == 0 else time.perf_counter()], dtype=torch.float64, device=device
            )
            every = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
            dist.all_gather(every, stamp)
            if rank == 0:
                seconds[method].append(max(e.item() for e in every[1:]) - every[0].item())
        if rank > 0:
            got = flat if receiver is None else receiver.td["w"]
            good = bool((got == (rounds % 256 if method == "broadcast" else float(rounds))).all())
        else:
            good = True
        flags = torch.tensor([int(good)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        ok[method] = bool(flags.item())
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
    return {"seconds": seconds, "ok": ok}
