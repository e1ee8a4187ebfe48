"""Torch-only NCCL checks for a GPU machine, run by ``bench/gpu_check.sh`` before cudarecv's NCCL tests.

No cudarecv code runs here: what fails here is NCCL's (or torch's), not cudarecv's.

``python bench/nccl_smoke.py self``
    One process, GPU 0: an NCCL group of world 1 (an ``all_reduce``), then one batch holding a send to
    itself and a receive from itself, posted through ``ProcessGroupNCCL``'s coalescing (what cudarecv
    does on a standalone group; ``dist.isend`` refuses a self peer) and checked.
``python bench/nccl_smoke.py pair [--logs DIR] [--timeout S] [--deadline S] [--backend gloo]``
    Two processes, both on GPU 0, each with its own ``NCCL_HOSTID`` and NCCL's socket transport on
    loopback (:data:`HOSTID_ENV`, the environment ``cudarecv.testing.gpu.nccl_ranks`` gives in its
    ``hostid`` mode): NCCL 2.28 then takes them for two nodes instead of refusing two ranks on one
    device. Rank 0 sends 1 MiB to rank 1 (``dist.send``/``dist.recv``), then both exchange in one
    ``batch_isend_irecv``, then an ``all_reduce``; each rank checks the values. Each rank's output
    (``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET`` where the caller sets them) goes to
    ``DIR/nccl-pair-rank<r>.log``. Every wait is bounded: the process groups time out after
    ``--timeout`` s, and ranks still running ``--deadline`` s after their start (default: twice the
    timeout) are killed. The ranks run in a session of their own (a signal to this process's group does
    not reach them), so this process kills their sessions on every way out: done, past the deadline, an
    exception, SIGINT or SIGTERM (``timeout -s INT`` in ``bench/gpu_check.sh``). ``--backend gloo`` runs
    the same over gloo with CPU tensors: this script's own check on a machine without a GPU.

Exit code 0 when every check passed, 1 otherwise (each failure printed), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

#: every rank's environment beyond its parent's (as cudarecv.testing.gpu.nccl_rank_env("hostid", r))
HOSTID_ENV: Mapping[str, str] = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_MNNVL_ENABLE": "0",
    "NCCL_NET": "Socket",
}
HOST = "127.0.0.1"
MIB_FLOATS = (1 << 20) // 4


def rank_env(rank: int) -> dict[str, str]:
    """What rank ``rank`` of the pair gets beyond its parent's environment."""
    return {**HOSTID_ENV, "NCCL_HOSTID": f"cudarecv-rank-{rank}"}


def _nccl_problem() -> str | None:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no GPU"
    return None


def check_self(timeout: float) -> int:
    """One rank: a world-1 NCCL group, then a batch of a send to itself and a receive from itself."""
    problem = _nccl_problem()
    if problem:
        print(f"self: FAILED: {problem}")
        return 1
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.HashStore()
    failures = []
    t0 = time.monotonic()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout)
    )
    try:
        x = torch.arange(8, dtype=torch.float32, device=device)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        ok = bool((x == torch.arange(8, dtype=torch.float32, device=device)).all())
        print(f"self: all_reduce on a world of 1: {'ok' if ok else 'WRONG VALUES'}")
        if not ok:
            failures.append("all_reduce")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("self", store), 0, 1, options)
        sent = torch.arange(MIB_FLOATS, dtype=torch.float32, device=device)
        got = torch.zeros_like(sent)
        try:
            pg._start_coalescing()  # (a backend's take no device; a ProcessGroup's do)
            pg.send([sent], 0, 0)
            pg.recv([got], 0, 0)
            work = pg._end_coalescing()
            work.wait()
            torch.cuda.synchronize()
            ok = torch.equal(got, sent)
            print(
                f"self: one batch, a send to itself and a receive from itself (1 MiB): "
                f"{'ok' if ok else 'WRONG VALUES'}"
            )
            if not ok:
                failures.append("self batch")
        except Exception as exc:  # noqa: BLE001 - what NCCL (or torch) says is the result
            print(f"self: one batch to itself: FAILED: {type(exc).__name__}: {exc}")
            failures.append("self batch")
        finally:
            pg.shutdown()
    finally:
        dist.destroy_process_group()
    print(
        f"self: {time.monotonic() - t0:.1f} s, {'FAILED: ' + ', '.join(failures) if failures else 'ok'}"
    )
    return 1 if failures else 0


def run_rank(rank: int, port: int, timeout: float, backend: str) -> int:
    """One rank of the pair (in its own process, its environment from :func:`rank_env`)."""
    import torch
    import torch.distributed as dist

    print(
        f"rank {rank} environment: "
        + " ".join(f"{k}={os.environ.get(k)}" for k in ("NCCL_HOSTID", *HOSTID_ENV)),
        flush=True,
    )
    gpu = backend == "nccl"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    store = dist.TCPStore(HOST, port, 3, is_master=False, timeout=timedelta(seconds=timeout))
    t0 = time.monotonic()
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout),
        device_id=device if gpu else None,  # NCCL's communicator now, so that a refusal shows here
    )
    steps = [f"init {time.monotonic() - t0:.2f} s"]
    failures = []
    peer = 1 - rank
    try:
        data = torch.arange(MIB_FLOATS, dtype=torch.float32, device=device)
        t = time.monotonic()
        if rank == 0:
            dist.send(data, dst=1)
        else:
            got = torch.zeros_like(data)
            dist.recv(got, src=0)
            sync()
            if not torch.equal(got, data):
                failures.append("send/recv: wrong values")
        sync()
        steps.append(f"send/recv 1 MiB {time.monotonic() - t:.3f} s")
        mine = torch.full((MIB_FLOATS,), float(rank + 1), device=device)
        theirs = torch.zeros_like(mine)
        t = time.monotonic()
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        )
        for work in works:
            work.wait()
        sync()
        if not bool((theirs == float(peer + 1)).all()):
            failures.append("batch_isend_irecv: wrong values")
        steps.append(f"batch_isend_irecv 1 MiB each way {time.monotonic() - t:.3f} s")
        total = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(total)
        sync()
        if not bool((total == 3.0).all()):
            failures.append("all_reduce: wrong values")
        steps.append("all_reduce ok")
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: " + "; ".join(steps) + (f"; FAILED: {failures}" if failures else "; ok"))
    return 1 if failures else 0


class _Stopped(Exception):
    """SIGINT or SIGTERM reached the parent of the pair."""


def _end_sessions(procs: list[subprocess.Popen]) -> None:
    """Kill each rank's session (the rank and anything it started), then reap the rank."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(
                    proc.pid, signal.SIGKILL
                )  # (start_new_session: its pid is its group's id)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def check_pair(
    logs: Path, timeout: float, backend: str = "nccl", deadline: float | None = None
) -> int:
    """Two ranks on GPU 0 in NCCL_HOSTID mode; see the module's docstring."""
    problem = _nccl_problem() if backend == "nccl" else None
    if problem:
        print(f"pair: FAILED: {problem}")
        return 1
    import torch.distributed as dist

    logs.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        HOST, 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    procs: list[subprocess.Popen] = []
    files = []
    codes: list[int | None] = []

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signal.Signals(signum).name)

    handlers = {}
    if threading.current_thread() is threading.main_thread():  # (only it may set handlers)
        handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(2):
            log = open(logs / f"nccl-pair-rank{rank}.log", "w")  # noqa: SIM115 - closed below
            files.append(log)
            env = dict(os.environ, **rank_env(rank))
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (--backend gloo)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "rank",
                        str(rank),
                        str(store.port),
                        str(timeout),
                        backend,
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        end = time.monotonic() + (2 * timeout if deadline is None else deadline)
        for proc in procs:
            try:
                codes.append(proc.wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    except _Stopped as why:
        print(f"pair: stopped by {why}: the ranks' sessions killed")
        return 1
    finally:
        _end_sessions(procs)
        for log in files:
            log.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    failed = False
    for rank, code in enumerate(codes):
        text = (logs / f"nccl-pair-rank{rank}.log").read_text(errors="replace")
        summary = [line for line in text.splitlines() if line.startswith(f"rank {rank}:")]
        print(summary[-1] if summary else f"rank {rank}: no result line")
        if code != 0:
            failed = True
            how = "did not finish in time (killed)" if code is None else f"exited with code {code}"
            print(f"pair: rank {rank} {how}; the last lines of its log:")
            print("\n".join("    " + line for line in text.splitlines()[-15:]))
    print(f"pair: {'FAILED' if failed else 'ok'} (logs: {logs}/nccl-pair-rank*.log)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("self", help="one rank: world 1, a batch to itself")
    one.add_argument("--timeout", type=float, default=30.0)
    two = sub.add_parser("pair", help="two ranks on GPU 0, NCCL_HOSTID mode")
    two.add_argument("--logs", type=Path, default=Path("."))
    two.add_argument("--timeout", type=float, default=45.0)
    two.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds the ranks may run (default: 2 x timeout)",
    )
    two.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    rank = sub.add_parser("rank", help="(internal) one rank of the pair")
    rank.add_argument("rank", type=int)
    rank.add_argument("port", type=int)
    rank.add_argument("timeout", type=float)
    rank.add_argument("backend", choices=["nccl", "gloo"])
    args = parser.parse_args(argv)
    if getattr(args, "timeout", 1.0) <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if getattr(args, "deadline", None) is not None and args.deadline <= args.timeout:
        parser.error(f"--deadline must be > --timeout ({args.timeout}), got {args.deadline}")
    if args.what == "self":
        return check_self(args.timeout)
    if args.what == "pair":
        return check_pair(args.logs, args.timeout, args.backend, args.deadline)
    return run_rank(args.rank, args.port, args.timeout, args.backend)


if __name__ == "__main__":
    sys.exit(main())
