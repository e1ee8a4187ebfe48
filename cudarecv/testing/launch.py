"""Run functions on N local ranks over loopback, bounded in time.

Used by the tests, the benchmarks and ``python -m cudarecv compare``. The
parent owns a ``TCPStore`` on 127.0.0.1 (port chosen by the OS, so no port
races). Each rank is a fresh process that joins it, initializes the default
group and also a standalone ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``)
built directly on the store (never registered with torch.distributed). A :class:`Cluster` keeps
its ranks for many calls, since starting one costs seconds; each call runs
``fn(rank, world_size, group, *args)`` on every rank, with ``group`` ``None``
(the default group) or the standalone group. Every wait is bounded: a rank that
raises, hangs or dies fails the call with a clear error, and the cluster is
then shut down, never reused in an unknown state. Every rank must also exit
normally: :meth:`Cluster.close` fails naming each rank that exited with a
signal (an abort at interpreter shutdown is SIGABRT) or another non-zero code.
A Ctrl-C reaches the parent alone (the ranks run in a session of their own, their
zygote's): a start or a call it interrupts kills every rank at once
(:meth:`Cluster.kill`), and the ranks print nothing.

Ranks are forked by this process's zygote (:mod:`cudarecv.testing.zygote`), which has
imported torch and tensordict once: a rank starts in a fraction of a second instead of
the 4-5 s of CPU an import costs, and still exits as a script does (threads joined,
``atexit``, module teardown, C++ destructors), so an abort or a hang at exit is seen.
A rank gets the environment of its parent at :class:`Cluster` creation, as a spawned
process would, plus ``env`` (every rank) and ``rank_env(rank)`` (that rank alone, e.g. the
distinct ``NCCL_HOSTID`` each NCCL rank sharing one GPU needs, :func:`cudarecv.testing.gpu.nccl_ranks`),
and talks to it over a socket of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from cudarecv import Error
from cudarecv.testing.zygote import zygote

HOST = "127.0.0.1"
GRACE = 5.0  # seconds a rank still busy in a failed call gets to leave before it is killed


class RankError(Error, RuntimeError):
    """A rank raised, died or did not finish in time."""


class RankExit(int):
    """The exit code of a rank that died where :meth:`Cluster.run` allowed it to."""


#: a rank's own environment variables, given its rank (see :class:`Cluster`)
RankEnv = Callable[[int], Mapping[str, str]]


class Cluster:
    """``world_size`` spawned ranks with their process groups, reused across calls.

    Each rank's environment is this process's at creation, updated with ``env`` and then
    with ``rank_env(rank)`` (its own values, e.g. ``{"NCCL_HOSTID": f"host-{rank}"}``).

    Example:
        >>> with Cluster(2) as cluster:
        ...     results = cluster.run(fn, args=(1 << 20,))  # fn(rank, world, group, 1 << 20)
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        pg_timeout: float = 30.0,
        start_timeout: float = 120.0,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
        rank_env: RankEnv | None = None,
        exit_timeout: float = 60.0,
    ) -> None:
        environs = _rank_environs(world_size, env, rank_env)
        self.world_size = world_size
        self.exit_timeout = exit_timeout  # generous: a rank's shutdown took 9.5 s at load 11 on 2 cores, 20-30+ s at 33
        self._died: set[int] = (
            set()
        )  # ranks that died where run() allowed it: their exit code is theirs
        self._store = dist.TCPStore(
            HOST,
            0,
            world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=start_timeout),
        )
        self._conns: list[Connection] = []
        self._procs = []
        self._closed = False
        try:
            for rank in range(world_size):
                ours, theirs = socket.socketpair()
                self._conns.append(Connection(ours.detach()))
                self._procs.append(
                    zygote().fork(
                        _rank_main,
                        (rank, world_size, self._store.port, pg_timeout, backend, environs[rank]),
                        theirs,
                    )
                )
        except BaseException:  # (a Ctrl-C too): no rank forked so far is left behind
            self.kill()
            raise
        self._collect(start_timeout, "start")

    def run(
        self,
        fn: Callable[..., Any],
        *,
        args: tuple = (),
        timeout: float = 60.0,
        standalone: bool = False,
        may_die: frozenset[int] | set[int] = frozenset(),
    ) -> list[Any]:
        """Call ``fn`` on every rank; return the results in rank order.

        A rank in ``may_die`` that dies gives :class:`RankExit` as its result
        (for tests that kill a peer on purpose); the cluster is closed afterwards
        (see :meth:`close`: the other ranks must still exit normally).

        Raises:
            RankError: with the rank's traceback if one raised, its exit code if it
                died, or the ranks still running after ``timeout`` seconds; the
                cluster is closed then; a rank that then exits abnormally is named
                on the message's last line (``at exit: ...``).
        """
        if self._closed:
            raise RankError("this cluster was closed after an earlier failure; start a new one")
        for conn in self._conns:
            with contextlib.suppress(OSError):  # that rank is gone: collecting says how
                conn.send((fn, args, standalone))
        results = self._collect(timeout, getattr(fn, "__name__", "fn"), frozenset(may_die))
        if any(isinstance(r, RankExit) for r in results):
            self.close()
        return results

    def _collect(
        self, timeout: float, what: str, may_die: frozenset[int] = frozenset()
    ) -> list[Any]:
        out: dict[int, Any] = {}
        raised: set[int] = set()  # back in their loop, like the ranks in ``out``
        deadline = time.monotonic() + timeout
        try:
            while len(out) < self.world_size:
                waiting: dict[Any, int] = {
                    self._conns[r]: r for r in range(self.world_size) if r not in out
                }
                for conn in wait(
                    list(waiting), timeout=max(0.0, min(0.2, deadline - time.monotonic()))
                ):
                    rank = waiting[conn]
                    try:
                        ok, value = self._conns[rank].recv()
                    except (EOFError, OSError):  # it died: its exit code says how
                        self._procs[rank].join(self.exit_timeout)
                        code = self._procs[rank].exitcode
                        if rank not in may_die:
                            raise RankError(
                                f"{what}: rank {rank} died ({_exit_status(code)})"
                            ) from None
                        assert code is not None  # (joined: its pipe closed as it died)
                        out[rank] = RankExit(code)
                        self._died.add(rank)
                        continue
                    if not ok:
                        raised.add(rank)
                        raise RankError(f"{what}: rank {rank} raised:\n{value}")
                    out[rank] = value
                if len(out) < self.world_size and time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in out]
                    raise RankError(
                        f"{what}: rank(s) {missing} did not finish within {timeout:.0f} s"
                    ) from None
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C: stop now, whatever the ranks are doing
                self.kill()
            elif not self._closed:
                self._closed = True
                failures = self._stop(busy=set(range(self.world_size)) - raised - set(out))
                if failures and isinstance(exc, RankError):
                    raise RankError(f"{exc}\nat exit: {'; '.join(failures)}") from None
            raise
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks: each is asked to leave and must exit with code 0 within ``exit_timeout`` s.

        Raises:
            RankError: naming each rank that exited with a signal (an abort at exit:
                SIGABRT), with another non-zero code, or not in time (then killed).
        """
        if self._closed:
            return
        self._closed = True
        failures = self._stop(busy=set())
        if failures:
            raise RankError(
                f"{len(failures)} rank(s) did not exit normally: " + "; ".join(failures)
            )

    def kill(self) -> None:
        """Stop every rank now (SIGKILL), whatever it is doing, and close the cluster; what they were doing is
        lost and nothing is reported. For a run the user interrupted (Ctrl-C): a rank busy in a call would
        only see :meth:`close`'s request once its call returned. Ranks hold nothing that outlives them (their
        shared memory is anonymous, their sockets close), and their zygote reaps them."""
        self._closed = True
        for p in self._procs:
            p.kill()
        deadline = time.monotonic() + GRACE
        for p in self._procs:
            p.join(
                max(deadline - time.monotonic(), 0.0)
            )  # (its zygote's report: at once, once it died)
        for conn in self._conns:
            conn.close()

    def _stop(self, busy: set[int]) -> list[str]:
        """Ask every rank to leave; kill those that do not in time. Ranks in ``busy`` (still in a
        failed call) get :data:`GRACE` s and may be killed unreported. Returns what went wrong."""
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        deadline = time.monotonic() + self.exit_timeout
        failures = []
        for rank, p in enumerate(self._procs):
            p.join(GRACE if rank in busy else max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join(5)
                if rank not in busy:
                    failures.append(
                        f"rank {rank} did not exit within {self.exit_timeout:g} s (killed)"
                    )
            elif rank not in busy | self._died and p.exitcode != 0:
                failures.append(f"rank {rank} {_exit_status(p.exitcode)}")
        for conn in self._conns:
            conn.close()
        return failures

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Ranks:
    """A :class:`Cluster` started on first use and restarted after a failure closed it.

    For test and bench fixtures: ``ranks()`` (or ``ranks.get()``) is a live cluster.
    ``cluster_kwargs`` go to each :class:`Cluster` it starts (``env``, ``rank_env``, ``backend``, ...).

    Example:
        >>> ranks = Ranks(2, pg_timeout=20.0)
        >>> ranks().run(fn)
    """

    def __init__(self, world_size: int = 2, **cluster_kwargs: Any) -> None:
        self.world_size = world_size
        self.cluster_kwargs = cluster_kwargs
        self._cluster: Cluster | None = None

    def get(self) -> Cluster:
        if self._cluster is None or self._cluster._closed:
            self._cluster = Cluster(self.world_size, **self.cluster_kwargs)
        return self._cluster

    __call__ = get

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()


def _rank_environs(
    world_size: int, env: Mapping[str, str] | None, rank_env: RankEnv | None
) -> list[dict[str, str]]:
    """Each rank's environment: this process's, then ``env``, then ``rank_env(rank)``.

    Raises:
        TypeError: a name or value in ``env`` or ``rank_env(rank)`` that is not a string
            (naming the argument and, for ``rank_env``, the rank).
    """
    base = dict(os.environ)
    base.update(_checked_env(env or {}, "env"))
    out = []
    for rank in range(world_size):
        environ = dict(base)
        if rank_env is not None:
            environ.update(_checked_env(rank_env(rank), f"rank_env({rank})"))
        out.append(environ)
    return out


def _checked_env(env: Mapping[str, str], what: str) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise TypeError(f"{what} must be a mapping of str to str, got {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"{what}: environment entries must be str to str, got {name!r}: {value!r}"
            )
    return dict(env)


def _exit_status(code: int | None) -> str:
    """How a process ended, in words: ``killed by SIGABRT (signal 6)``, ``exited with code 3``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def run(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    standalone: bool = False,
) -> list[Any]:
    """Start ranks, run ``fn`` once on each, stop them (see :class:`Cluster`)."""
    with Cluster(world_size, pg_timeout=pg_timeout, start_timeout=timeout) as cluster:
        return cluster.run(fn, args=args, timeout=timeout, standalone=standalone)


def _rank_main(
    conn: Connection,
    rank: int,
    world_size: int,
    port: int,
    pg_timeout: float,
    backend: str,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's, as at Cluster creation (not the zygote's, from its start)
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        timeout = timedelta(seconds=pg_timeout)
        store = dist.TCPStore(HOST, port, world_size + 1, is_master=False, timeout=timeout)
        if backend == "nccl":
            # GPU rank % count: one GPU per rank, or ranks sharing GPUs (each its own NCCL_HOSTID, or
            # NCCL_MULTI_RANK_GPU_ENABLE=1: cudarecv.testing.gpu.nccl_ranks)
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        prefix = dist.PrefixStore("standalone", store)
        standalone: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if backend == "gloo":
            standalone = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            standalone = dist.ProcessGroupNCCL(prefix, rank, world_size, options)
        conn.send((True, None))
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            break
        if job is None:
            break
        fn, args, use_standalone = job
        try:
            reply = (True, fn(rank, world_size, standalone if use_standalone else None, *args))
            conn.send(reply)
        except BaseException:
            conn.send((False, traceback.format_exc()))
    conn.close()
    dist.destroy_process_group()
