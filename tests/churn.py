"""Membership churn for the elastic weight-sync tests: actors forked from the zygote join a named sender through a
TCP store, pull, and report every version they pulled (in the store); the test starts, closes, SIGKILLs,
SIGSTOPs and continues them at random while a trainer pushes, each event ordered by the actors' store signals.

The weights of version ``v`` are ``w == v`` and ``b == -v`` everywhere: a version that is not whole (a mix of
two, or half-written) shows in any element.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import signal
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.zygote import zygote

WAIT = 120.0  # seconds any signal of the actors may take (a loaded 2-core machine)
PACE = 0.005  # seconds between a trainer's pushes
ELEMENTS = 1 << 16  # per leaf: 256 KiB of float32, many messages per version on the wire


def weights(version: int = 0) -> TensorDict:
    return TensorDict(
        w=torch.full((ELEMENTS,), float(version)), b=torch.full((ELEMENTS // 4,), -float(version))
    )


def store_client(port: int, host: str = "127.0.0.1") -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=WAIT))


def trainer(conn: Any, host: str, port: int, name: str, mode: str, timeout: float) -> None:
    """A trainer in a process of its own: push until told to close (it may be SIGKILLed instead); the last
    version pushed in the store, rewritten after each push."""
    conn.close()
    store = store_client(port, host)
    td = weights()
    sender = cudarecv.ElasticSender(td, store=store, name=name, mode=mode, timeout=timeout)
    # (a client of the pusher's own: this thread's wait below holds its client, one operation at a time)
    pusher = Pusher(sender, td, store.clone(), f"{name}/trainer/{sender.generation}/version")
    store.wait([f"{name}/trainer/{sender.generation}/close"], datetime.timedelta(seconds=WAIT))
    pusher.stop()
    sender.close()
    assert not pusher.errors, pusher.errors


def actor(conn: Any, host: str, port: int, name: str, index: int, timeout: float) -> None:
    """An actor: join ``name``, then pull until told to close; every pull's version and wholeness in the store."""
    if conn is not None:
        conn.close()
    store = store_client(port, host)
    receiver = cudarecv.ElasticReceiver(store=store, name=name, timeout=timeout)
    stats = {
        "pulled": 0,
        "first": None,
        "last": 0,
        "torn": 0,
        "not_newer": 0,
        "rejoins": 0,
        "id": receiver.id,
    }
    key = f"churn/{index}"
    generation, answered = receiver.generation, 0
    while not store.check([f"{key}/close"]):
        try:
            version = receiver.pull(timeout=5.0)
        except cudarecv.WaitTimeout:
            continue  # nothing newer yet: look for the close signal, then pull on
        except (
            cudarecv.SenderClosed,
            cudarecv.LinkError,
        ):  # the trainer is gone, none new yet: pull on
            if stats["last"]:  # its last version stays readable meanwhile
                with receiver.reading() as td:
                    stats["torn"] += not bool((td["w"] == stats["last"]).all())
            stats["sender_gone"] = stats.get("sender_gone", 0) + 1
            store.set(f"{key}/stats", json.dumps(stats))
            continue
        with receiver.reading() as td:
            whole = bool((td["w"] == version).all()) and bool((td["b"] == -version).all())
        stats["torn"] += not whole
        stats["not_newer"] += version <= stats["last"]
        rejoined = receiver.generation != generation or receiver.id != stats["id"]
        stats["rejoins"] += rejoined
        # sync mode: every version pushed while it is served (a gap only where it was dropped and joined again)
        stats["gaps"] = stats.get("gaps", 0) + (
            receiver.mode == "sync"
            and stats["last"] > 0
            and version > stats["last"] + 1
            and not rejoined
        )
        stats.update(
            pulled=stats["pulled"] + 1,
            last=version,
            first=stats["first"] or version,
            id=receiver.id,
        )
        generation = receiver.generation
        store.set(f"{key}/stats", json.dumps(stats))
        if (
            store.check([f"{key}/ping"]) and int(store.get(f"{key}/ping")) > answered
        ):  # "pulled after my ping"
            answered = int(store.get(f"{key}/ping"))
            store.set(f"{key}/pong/{answered}", "1")
    receiver.close()
    store.set(f"{key}/closed", "1")


class Fleet:
    """The actors of one churn run, and the events on them (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        port: int,
        name: str,
        timeout: float,
        seed: int,
        host: str = "127.0.0.1",
        fork: Any = None,
        first: int = 1,
    ) -> None:
        self.store, self.port, self.name, self.timeout, self.host = store, port, name, timeout, host
        self.rng = random.Random(seed)
        self.fork = fork or fork_process
        self.running: dict[int, Any] = {}  # index -> process
        self.stopped: dict[int, Any] = {}
        self.ended: list[tuple[int, Any, str]] = []  # (index, process, how)
        self.first, self.count = first, first - 1  # the actors' indices: first, first + 1, ...
        self.pings: dict[int, int] = {}
        self.events: dict[str, int] = {"start": 0, "close": 0, "kill": 0, "stop": 0, "cont": 0}

    def ping(self, index: int) -> str:
        """Ask actor ``index`` to say when it next pulled: the key to wait for (see :meth:`pulled`)."""
        self.pings[index] = self.pings.get(index, 0) + 1
        self.store.set(f"churn/{index}/ping", str(self.pings[index]))
        return f"churn/{index}/pong/{self.pings[index]}"

    def pulled(self, index: int, pong: str) -> None:
        """Until actor ``index`` pulled a version after the ping that gave ``pong`` (its store signal)."""
        try:
            self.store.wait([pong], datetime.timedelta(seconds=WAIT))
        except Exception as error:
            process = self.running.get(index) or self.stopped.get(index)
            stats = (
                self.store.get(f"churn/{index}/stats")
                if self.store.check([f"churn/{index}/stats"])
                else None
            )
            raise AssertionError(
                f"actor {index} pulled no version within {WAIT:g} s (its exit code: "
                f"{None if process is None else process.exitcode}; its stats: {stats})"
            ) from error

    def pulled_beyond(self, index: int, version: int) -> None:
        """Until actor ``index`` pulled a version above ``version`` (bounded by :data:`WAIT` in all): a pull that
        ends after a ping may still bring an older sender's last reply, sent before it died."""
        deadline = time.monotonic() + WAIT
        while True:
            self.pulled(index, self.ping(index))
            if json.loads(self.store.get(f"churn/{index}/stats"))["last"] > version:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"actor {index} pulled nothing above version {version} within {WAIT:g} s"
                )

    def start(self) -> None:
        index = self.count = self.count + 1
        pong = self.ping(index)
        self.running[index] = self.fork(
            actor, (self.host, self.port, self.name, index, self.timeout)
        )
        self.pulled(index, pong)

    def close(self, index: int) -> None:
        process = self.running.pop(index)
        self.store.set(f"churn/{index}/close", "1")
        process.join(WAIT)
        assert process.exitcode == 0, (
            f"actor {index} exited with {process.exitcode} after its close"
        )
        self.ended.append((index, process, "closed"))

    def kill(self, index: int) -> None:
        process = self.running.pop(index, None) or self.stopped.pop(index)
        os.kill(process.pid, signal.SIGKILL)
        process.join(WAIT)
        self.ended.append((index, process, "killed"))

    def stop(self, index: int) -> None:
        process = self.running.pop(index)
        os.kill(process.pid, signal.SIGSTOP)
        self.stopped[index] = process

    def cont(self, index: int) -> None:
        process = self.stopped.pop(index)
        pong = self.ping(index)
        os.kill(process.pid, signal.SIGCONT)
        self.running[index] = process
        self.pulled(index, pong)  # (dropped meanwhile or not, it goes on)

    def event(self, most: int = 4) -> str:
        """One membership event, at random among those possible now."""
        choices = []
        if len(self.running) + len(self.stopped) < most:
            choices += ["start"] * 3
        if len(self.running) > 1:
            choices += ["close", "kill", "stop"]
        if self.stopped:
            choices += ["cont", "kill"]
        if not choices:
            choices = ["start"]
        what = self.rng.choice(choices)
        if what == "start":
            self.start()
        elif what == "cont":
            self.cont(self.rng.choice(sorted(self.stopped)))
        elif what == "kill" and self.stopped and (not self.running or self.rng.random() < 0.5):
            self.kill(self.rng.choice(sorted(self.stopped)))
        else:
            getattr(self, what)(self.rng.choice(sorted(self.running)))
        self.events[what] += 1
        return what

    def end(self) -> None:
        """Close the running actors, kill the stopped ones."""
        for index in sorted(self.stopped):
            self.kill(index)
        for index in sorted(self.running):
            self.close(index)

    def stats(self) -> dict[int, dict]:
        return {
            i: json.loads(self.store.get(f"churn/{i}/stats"))
            for i in range(self.first, self.count + 1)
            if self.store.check([f"churn/{i}/stats"])
        }


class Spawned:
    """An actor started as a process of its own inside a simulated host (see :func:`in_host`), watched as a
    forked one is."""

    def __init__(self, proc: Any) -> None:
        self.proc, self.pid = proc, proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(Exception):
            self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def in_host(namespace: str) -> Any:
    """A ``Fleet`` fork that starts each actor inside the network namespace ``namespace`` (a simulated host)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))

    def start(target: Any, args: tuple) -> Spawned:
        code = f"import sys; sys.path.insert(0, {here!r}); import churn; churn.{target.__name__}(None, *{args!r})"
        return Spawned(
            subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, "-c", code],
                env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0"},
                start_new_session=True,
            )
        )

    return start


def fork_process(target: Any, args: tuple) -> Any:
    ours, theirs = socket.socketpair()
    process = zygote().fork(target, args, theirs)
    ours.close()
    return process


class Pusher:
    """The trainer's loop: push version after version (each ``w == v``, ``b == -v``) until stopped; any push that
    raises is kept (the tests require none)."""

    def __init__(self, sender: Any, td: TensorDict, store: Any = None, key: str = "") -> None:
        self.sender, self.td, self.store, self.key = sender, td, store, key
        self.errors: list[BaseException] = []
        self.pushed = threading.Condition()  # notified after each push (and when the loop ends)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="churn-pusher")
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            version = self.sender.version + 1
            self.td["w"].fill_(version)
            self.td["b"].fill_(-version)
            try:
                assert self.sender.push() == version
            except BaseException as error:  # noqa: BLE001 - the test reports it
                self.errors.append(error)
                with self.pushed:
                    self.pushed.notify_all()
                return
            with self.pushed:
                self.pushed.notify_all()
            if self.store is not None:  # (a trainer of its own: what it pushed, for the test)
                self.store.set(self.key, str(version))
            self._stop.wait(
                PACE
            )  # (a trainer's step takes a while: the actors, on 2 cores too, get their turn)

    def next_push(self) -> None:
        """Until the loop's next push ended (within WAIT); raises if the loop stopped on an error. Nothing else
        may push meanwhile: the loop's weights are ``sender.version + 1`` when it fills them."""
        with self.pushed:
            version = self.sender.version
            ended = self.pushed.wait_for(
                lambda: self.errors or self.sender.version > version, timeout=WAIT
            )
        assert not self.errors, f"a push raised: {self.errors[0]!r}"
        assert ended, f"the pusher pushed nothing within {WAIT:g} s"

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the pusher did not stop"


def resources() -> dict:
    """This process's threads, open descriptors and resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "resident": resident,
    }


@contextlib.contextmanager
def master_store(address: str = "127.0.0.1") -> Any:
    store = dist.TCPStore(
        address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=WAIT)
    )
    try:
        yield store
    finally:
        del store
