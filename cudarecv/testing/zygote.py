"""A process that imports torch once and forks ranks that exit as a script does.

Starting a rank costs 4-5 s of CPU, nearly all of it importing torch and tensordict;
a test suite of many clusters spends most of its time there. The zygote is one
``python -m cudarecv.testing.zygote`` per parent process that has imported
:data:`PRELOAD` (never initializing CUDA) and forks each rank from there.

Unlike multiprocessing's fork server, whose children end in ``os._exit``, a forked
rank returns from the zygote's ``main`` and ends the way ``python script.py`` does:
non-daemon threads joined, ``atexit`` handlers, module teardown, C++ static
destructors. An abort or a hang at exit is therefore seen, not hidden. The zygote
reaps each rank and reports its exit code (negative: the signal) to the parent.

Example:
    >>> a, b = socket.socketpair()
    >>> rank = zygote().fork(my_main, (1, 2), conn=b)  # my_main(Connection, 1, 2) in the child
    >>> rank.join(10.0); rank.exitcode
    0
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

#: imported once by the zygote for every rank it forks (torch does not initialize CUDA at import)
PRELOAD = ["numpy", "torch", "torch.distributed", "tensordict"]
POLL = 0.1  # seconds between a waiting thread's turns at the zygote's reports


class ZygoteError(RuntimeError):
    """The zygote did not start, or went away."""


class Forked:
    """A rank forked by the zygote, with ``multiprocessing.Process``'s ways to watch it."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    @property
    def exitcode(self) -> int | None:
        """``None`` while it runs; its exit code, or minus the signal that ended it."""
        return self._zygote.exitcode(self.pid, 0.0)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._zygote.exitcode(self.pid, timeout)

    def kill(self) -> None:
        if self.is_alive():  # (reaped ones are not signalled: their pid may be another's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """The parent's side: forks ranks and collects their exit codes."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        ours, theirs = socket.socketpair()
        # a session of its own, and so of its ranks': a terminal's Ctrl-C (SIGINT to its foreground process
        # group) reaches the parent only, which stops its ranks (a Cluster kills them when interrupted); a
        # rank interrupted at any moment of its own (connecting, in a call, exiting) would print a traceback
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        try:
            if not self._conn.poll(start_timeout):
                raise ZygoteError(f"the zygote did not import {PRELOAD} within {start_timeout:g} s")
            self._pid = self._recv()[1]
        except BaseException:  # (a Ctrl-C too): no zygote is left behind, still importing
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
            raise

    def fork(self, target: Callable[..., object], args: tuple, conn: socket.socket) -> Forked:
        """Run ``target(Connection(conn), *args)`` in a new rank; ``conn`` is closed here."""
        spec = (sys.path, os.getcwd(), _main_module(), pickle.dumps((target, args)))
        with self._lock:
            self._conn.send(spec)
            send_handle(self._conn, conn.fileno(), self._pid)
            conn.close()
            while True:
                kind, pid, *_ = self._recv()
                if kind == "forked":
                    return Forked(self, pid)

    def exitcode(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once reported, waiting up to ``timeout`` s (``None``: for good)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
                if self._conn.poll(
                    max(left, 0.0)
                ):  # (reports already there are read even with no time left)
                    self._recv()
                elif left <= 0:
                    return None

    def _recv(self) -> tuple:
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ZygoteError(f"the zygote went away (exit code {self._proc.poll()})") from exc
        if message[0] == "exited":
            self._exits[message[1]] = message[2]
        return message

    def close(self) -> None:
        """Stop the zygote (ranks still running are killed by it)."""
        self._conn.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use and stopped at exit."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None:
            _ZYGOTE = Zygote()
            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def main(fd: int) -> None:
    """The zygote: import :data:`PRELOAD`, then fork a rank per request until the parent leaves.

    Returns in the zygote when the parent closed its end, and in each forked rank once
    its target returned (the rank then exits as a script does).
    """
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a Ctrl-C is for the parent, which then stops the ranks
    for name in PRELOAD:
        importlib.import_module(name)
    conn = Connection(fd)
    children: dict[int, int] = {}  # pidfd -> pid
    if not _tell(conn, ("ready", os.getpid()), children):
        return
    selector = selectors.DefaultSelector()
    selector.register(conn.fileno(), selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fd != conn.fileno():
                pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                if not _tell(
                    conn,
                    ("exited", pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])),
                    children,
                ):
                    return
                continue
            try:
                spec = conn.recv()
                handle = recv_handle(conn)
            except (EOFError, OSError):  # the parent is gone: so are its ranks
                _end_children(children)
                return
            pid = os.fork()
            if pid == 0:
                selector.close()
                for pidfd in children:
                    os.close(pidfd)
                conn.close()
                signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
                _run(spec, handle)
                return
            os.close(handle)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            selector.register(pidfd, selectors.EVENT_READ)
            if not _tell(conn, ("forked", pid), children):
                return


def _tell(conn: Connection, message: tuple, children: dict[int, int]) -> bool:
    """Send ``message`` to the parent; False, with every rank ended, if the parent is gone (it exited, or was
    interrupted while this zygote started or forked): the zygote then leaves quietly, as on EOF."""
    try:
        conn.send(message)
        return True
    except OSError:  # BrokenPipeError, ConnectionResetError
        _end_children(children)
        return False


def _end_children(children: dict[int, int]) -> None:
    """Kill and reap every rank still running (their parent is gone)."""
    for pid in children.values():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _main_module() -> tuple[str, str] | None:
    """How a rank finds the parent's ``__main__`` (its functions pickle by that name): ``("name", module)``
    for ``python -m module``, ``("path", file)`` for a script, None where there is none (an interpreter, or a
    package's ``__main__``, which spawn does not run again either)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return (
            None if spec.name.endswith("__main__") or spec.name == __name__ else ("name", spec.name)
        )
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path and path.endswith(".py") else None


def _run(spec: tuple, handle: int) -> None:
    path, cwd, main, payload = spec
    sys.path[:] = path
    os.chdir(cwd)
    if (
        main is not None
    ):  # the parent's __main__ run again as __mp_main__ (its guarded part does not run), as spawn does
        how, where = main
        found = (
            runpy.run_module(where, run_name="__mp_main__", alter_sys=True)
            if how == "name"
            else runpy.run_path(where, run_name="__mp_main__")
        )
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(found)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    target, args = pickle.loads(payload)
    target(Connection(handle), *args)


if __name__ == "__main__":
    main(int(sys.argv[1]))
