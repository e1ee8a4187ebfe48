"""``python -m cudarecv tune``: measure this machine's host copies and direct reads, and keep the choice
in ``$XDG_CACHE_HOME/cudarecv/tune.json`` (``~/.cache/cudarecv/tune.json`` without it), where every later
process reads it; ``CUDARECV_HOST_COPY`` and ``CUDARECV_DIRECT_READ`` override it.

Usage::

    python -m cudarecv tune [--rounds N] [--show]

Measures, in this process alone (run it on an otherwise idle machine: on a loaded one the
times, and so the choice, are close to random):

- host copies: two native copies of 64 MiB at once (as a sender filling a segment and a
  receiver emptying one), streaming their stores past the caches vs glibc's memcpy,
  alternating, the best of ``--rounds`` each; streaming replaces the default (glibc's
  memcpy) only if it is at least ``MARGIN`` faster;
- direct reads of a same-host peer: ``process_vm_readv`` of 16 MiB of this process's own
  torch memory, in 8 KiB regions (leaves) and in one (a storage), vs the same copies by a
  copy table; it pays where it takes at most ``DIRECT_SLACK`` times the copies.

The choices and their times are this machine's entry of the tune file (:mod:`cudarecv.core.tuned`), which
a process reads at its first large copy or same-host offer. ``--show`` prints what is in effect and
why, measuring nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from cudarecv import ArgumentError
from cudarecv.core.host_copy import (
    DEFAULT_HOST_COPY,
    DIRECT_ENV,
    DIRECT_SLACK,
    ENV,
    NATIVE,
    WHY_NOT_NATIVE,
    CopyTable,
    DirectRead,
    copy_bytes,
    direct_read_choice,
    host_copy_setting,
    may_read_process,
    read_process,
    set_streaming,
)
from cudarecv.core.log import logger
from cudarecv.core.tuned import entry, machine, path, save

from .cli import error, int_at_least

COPY_BYTES = 64 << 20  # larger than the last-level caches of today's servers
READ_BYTES, READ_PIECE = 16 << 20, 8 << 10
MARGIN = 1.1  # how much faster than the default the other host copy must be to replace it
WAIT = 60.0  # seconds the copies of one measurement may take in all


def best_time(run: Callable[[], Any], rounds: int) -> float:
    """The shortest of ``rounds`` runs of ``run()``, in seconds."""
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _copies_at_once(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds from the start of the first to the end of the last of one native copy per (destination,
    source) pair, each on a thread of its own, started together (the copy releases the GIL)."""
    ready = threading.Barrier(len(pairs))
    spans: list[tuple[float, float]] = []

    def one(dst: torch.Tensor, src: torch.Tensor) -> None:
        ready.wait(timeout=WAIT)
        start = time.perf_counter()
        copy_bytes(dst, src)
        spans.append((start, time.perf_counter()))

    threads = [threading.Thread(target=one, args=pair, name="cudarecv-tune") for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT)
    if len(spans) < len(pairs):
        raise RuntimeError(
            f"{len(pairs) - len(spans)} of {len(pairs)} copies did not end within {WAIT} s"
        )
    return max(end for _, end in spans) - min(start for start, _ in spans)


def measure_host_copy(rounds: int) -> tuple[str, dict[str, float]]:
    """The faster native copy here (``"stream"`` or ``"memcpy"``) and the best time of each: two copies of
    ``COPY_BYTES`` at once, as a sender filling a segment and a receiver emptying one, streaming and not
    alternating round by round. Needs the native build."""
    pairs = [
        (torch.zeros(COPY_BYTES, dtype=torch.uint8), torch.ones(COPY_BYTES, dtype=torch.uint8))
        for _ in range(2)
    ]  # (pages touched)
    times = {"stream": math.inf, "memcpy": math.inf}
    for _ in range(rounds):
        for choice in times:
            set_streaming(choice == "stream")
            times[choice] = min(times[choice], _copies_at_once(pairs))
    other = next(c for c in times if c != DEFAULT_HOST_COPY)
    return (other if times[other] * MARGIN < times[DEFAULT_HOST_COPY] else DEFAULT_HOST_COPY), times


def _read_vs_copy(piece: int, rounds: int) -> tuple[bool, float, float]:
    """Whether this process reads all of a buffer into another (in regions of ``piece`` bytes) with
    ``process_vm_readv``, and the best times of that read and of the same copies by a copy table.
    torch's memory, as what is read: numpy's large arrays may sit on huge pages, which the kernel reads
    2.4x faster than torch's (256 MiB on a 2-core AMD EPYC VM: 18.7 vs 45.0 ms)."""
    src, dst = torch.ones(READ_BYTES, dtype=torch.uint8), torch.zeros(READ_BYTES, dtype=torch.uint8)
    starts = np.arange(0, READ_BYTES, piece, dtype=np.uint64)
    sizes = np.full_like(starts, piece)
    local = np.stack([dst.data_ptr() + starts, sizes], axis=1)
    remote = np.stack([src.data_ptr() + starts, sizes], axis=1)
    table = CopyTable(np.stack([local[:, 0], remote[:, 0], sizes], axis=1))
    whole = read_process(os.getpid(), local, remote) == READ_BYTES
    table.run(0, len(starts))  # (pages touched)
    read = best_time(lambda: read_process(os.getpid(), local, remote), rounds)
    copied = best_time(lambda: table.run(0, len(starts)), rounds)
    return whole, read, copied


def measure_direct_read(rounds: int) -> tuple[DirectRead, dict[str, Any]]:
    """Where reading a same-host peer's memory directly pays here, and the times it was chosen by."""
    why_not = may_read_process(os.getpid())
    if why_not is not None:
        return DirectRead(False, False), {"not allowed": why_not}
    measured, pays = {}, []
    for name, piece in (("leaves", READ_PIECE), ("storages", READ_BYTES)):
        whole, read, copied = _read_vs_copy(piece, rounds)
        measured[name] = {"read_s": read, "copy_s": copied, "whole": whole}
        pays.append(whole and read <= DIRECT_SLACK * copied)
    return DirectRead(leaves=pays[0], storages=pays[0] or pays[1]), measured


def tune(rounds: int) -> int:
    """Measure, print, keep the choices; 0."""
    print(f"machine: {machine()}")
    settings: dict[str, Any] = {}
    measured: dict[str, Any] = {}
    if NATIVE:
        choice, times = measure_host_copy(rounds)
        settings["host_copy"], measured["host_copy"] = choice, times
        print(
            f"host copies, 2 x {COPY_BYTES >> 20} MiB at once (best of {rounds}): stream {times['stream'] * 1e3:.2f} ms, "
            f"memcpy {times['memcpy'] * 1e3:.2f} ms -> {choice}"
        )
        set_streaming(choice == "stream")  # (the direct reads' copies as a transfer's would be)
    else:
        print(f"host copies: memmove ({WHY_NOT_NATIVE}); nothing to choose")
    pays, reads = measure_direct_read(rounds)
    settings["direct_read"], measured["direct_read"] = pays._asdict(), reads
    if "not allowed" in reads:
        print(f"direct reads: off (this process may not read itself: {reads['not allowed']})")
    else:
        print(
            f"direct reads of {READ_BYTES >> 20} MiB (best of {rounds}): "
            + "; ".join(
                f"{name} {t['read_s'] * 1e3:.2f} ms vs copies {t['copy_s'] * 1e3:.2f} ms"
                for name, t in reads.items()
            )
            + f" -> {pays.describe()}"
        )
    where = save(settings, measured, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    logger.info("tuned %s: %s", machine(), settings)
    print(f"kept in {where}")
    told = [f"{env}={os.environ[env]}" for env in (ENV, DIRECT_ENV) if env in os.environ]
    if told:
        print(f"(overridden in this environment by {', '.join(told)})")
    return 0


def show() -> int:
    """Print the settings in effect and why; 0."""
    print(f"machine: {machine()}")
    kept = entry()
    print(
        f"tune file: {path()} ({'tuned ' + kept.get('at', '?') if kept else 'no entry for this machine'})"
    )
    copy, why = host_copy_setting()
    print(f"host copies: {copy if NATIVE else 'memmove'} ({why if NATIVE else WHY_NOT_NATIVE})")
    pays, why = direct_read_choice()
    print(f"direct reads: {pays.describe()} ({why})")
    return 0


def run(args: argparse.Namespace) -> int:
    """``tune`` or ``tune --show``; 2 on a bad setting or tune file."""
    try:
        return show() if args.show else tune(args.rounds)
    except ArgumentError as exc:
        error("tune", str(exc))
        return 2


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand."""
    p = subparsers.add_parser(
        "tune",
        help="measure this machine's host copies and direct reads, and keep the faster choice",
    )
    p.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=5,
        metavar="N",
        help="runs of each measurement, the best one counts (default 5)",
    )
    p.add_argument(
        "--show",
        action="store_true",
        help="print the settings in effect and why, measuring nothing",
    )
    p.set_defaults(func=run)
    return p
