"""The store keys through which receivers find a named sender, and join it; every record read back is checked.

Under ``cudarecv/weights/<name>/`` in the user's store (a TCPStore or FileStore any process can reach):

- ``generation``: a counter; each :class:`~cudarecv.WeightSender` built with the store and name takes the next
  (a trainer that restarts is a new generation), writes its record ``g<N>/sender`` (host, pid, mode, timeout, as
  JSON), then names itself in ``current``. A sender whose generation is no longer ``current`` is fenced: its next
  push closes it (:class:`~cudarecv.SenderFenced`), so two live trainers never serve one name;
- ``version``: the counter of versions pushed under the name, by any generation: each push takes the next number
  before it sends anything, so the versions a receiver gets strictly increase across trainer restarts, and a
  number a crashed push took is never given again;
- ``g<N>/joins``: a counter; a receiver takes the next number ``k`` and writes ``g<N>/join/<k>`` (its host and
  pid, only if the key is free); the two then form a gloo group of their own on ``g<N>/pair/<k>/`` (the sender
  rank 0) and run the weight-sync handshake over it. Each receiver then marks number ``k - 1`` ``{"skip": true}``
  if it is still free (its receiver died between taking it and writing it, or is late and takes another), so the
  sender's admission thread, which takes the requests in order, never waits on a number nobody will write;
- ``g<N>/join/<k>`` with ``{"closing": <token>}``: the sender closed (it wakes its own admission thread; the token
  lives only in the sender's process, so no other writer can end its admissions);
- ``g<N>/alive/<k>``: receiver ``k``'s heartbeat counter; ``g<N>/dropped/<k>``: the sender dropped it
  (:mod:`.heartbeat`);
- ``g<N>/edge/<a>-<b>/<v>/``: relay fan-out: the gloo pair of receivers ``a < b``, formed when the push of version
  ``v`` first names them neighbours in its chain (rank 0: ``a``).

The store is shared and may hold anything: every record is parsed into a small dataclass and bounded before it is
used (:class:`SenderRecord`, :class:`JoinRecord`); one that cudarecv did not write raises
:class:`~cudarecv.StoreRecordError` naming its key and the fix, and a store that fails raises
:class:`~cudarecv.StoreError`. Every wait of a receiver is bounded by its caller's time and ends at once when the
receiver closes (it polls the store with ``check``, which never blocks, rather than blocking in ``wait``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ...core.checks import MAX_TIMEOUT
from ...core.errors import (
    ArgumentError,
    SenderClosed,
    StoreError,
    StoreRecordError,
    UsageError,
    WaitTimeout,
)
from ...samehost.machine import host_id

if TYPE_CHECKING:
    import torch.distributed as dist

#: how long one wait of the admission thread for the next join lasts before it waits again (the sender's close
#: wakes it at once, with a record of its own; a store whose wait runs out logs a warning, hence not shorter)
ADMISSION_WAIT = 600.0
#: bounds of what a record may hold: its JSON, a host's name, a pid (Linux's largest pid_max), a counter
MAX_RECORD_BYTES = 4096
MAX_HOST_CHARS = 256
MAX_PID = 1 << 22
MAX_COUNT = 1 << 62
#: how many join numbers a receiver takes before it gives up (each lost only to a receiver after it that found it
#: unwritten: a few microseconds' window)
JOIN_TRIES = 16
#: a receiver's wait for a key: the first and the longest interval between two looks (``check``)
POLL_FIRST, POLL_MOST = 0.005, 0.1

Mode = Literal["sync", "latest"]
T = TypeVar("T")


@dataclass(frozen=True)
class SenderRecord:
    """A generation's sender, as it announced itself in ``g<N>/sender``."""

    host: str
    pid: int
    mode: Mode
    timeout: float  # how long a receiver's heartbeat may stand still before it is dropped

    def to_json(self) -> str:
        return json.dumps(
            {"host": self.host, "pid": self.pid, "mode": self.mode, "timeout": self.timeout}
        )

    @classmethod
    def parse(cls, raw: bytes, key: str) -> SenderRecord:
        fields = _object(raw, key, "a sender's record")
        mode = fields.get("mode")
        if mode not in ("sync", "latest"):
            raise _bad(key, "a sender's record", f"its mode is {mode!r}, not 'sync' or 'latest'")
        timeout = fields.get("timeout")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT
        ):
            raise _bad(
                key,
                "a sender's record",
                f"its timeout is {timeout!r}, not a number of seconds in (0, {MAX_TIMEOUT:g}]",
            )
        return cls(
            _host(fields, key, "a sender's record"),
            _pid(fields, key, "a sender's record"),
            mode,
            float(timeout),
        )


@dataclass(frozen=True)
class JoinRecord:
    """What ``g<N>/join/<k>`` holds: a receiver's request to join (its host and pid), a number to skip (taken and
    never written: a later receiver marks it), or the sender's own close (its token)."""

    kind: Literal["join", "skip", "closing"]
    host: str = ""
    pid: int = 0
    token: str = ""  # closing: the token of the sender that closed

    def to_json(self) -> str:
        if self.kind == "closing":
            return json.dumps({"closing": self.token})
        if self.kind == "skip":
            return json.dumps({"skip": True})
        return json.dumps({"host": self.host, "pid": self.pid})

    @classmethod
    def parse(cls, raw: bytes, key: str) -> JoinRecord:
        fields = _object(raw, key, "a join request")
        if "closing" in fields:
            if not isinstance(fields["closing"], str) or len(fields["closing"]) > MAX_HOST_CHARS:
                raise _bad(key, "a join request", "its closing token is not a short string")
            return cls("closing", token=fields["closing"])
        if fields.get("skip") is True:
            return cls("skip")
        return cls(
            "join", _host(fields, key, "a join request"), _pid(fields, key, "a join request")
        )


class Directory:
    """One sender name's keys in a store (see the module docstring)."""

    def __init__(self, store: Any, name: Any, timeout: float) -> None:
        if store is None or not hasattr(store, "add") or not hasattr(store, "wait"):
            raise ArgumentError(
                f"`store` must be a torch.distributed.Store (TCPStore, FileStore), got {store!r}"
            )
        if not isinstance(name, str) or not name or "/" in name:
            raise ArgumentError(
                f"`name` must be a non-empty string without '/' (the sender's name in the store), "
                f"got {name!r}"
            )
        # a client of its own: a push takes its version's number in the store, and must not wait behind a
        # blocking wait of the caller's on its client (a TCPStore client runs one operation at a time); its calls
        # wait at most ``timeout`` for a store that stopped answering
        self.store, self.name = own_client(store, timeout), name
        self.root = f"cudarecv/weights/{name}"

    def key(self, *parts: object) -> str:
        return "/".join([self.root, *map(str, parts)])

    # -- the store's calls, each failure a StoreError naming its key -------------------------------------------
    def call(self, what: str, key: str, operation: Callable[[], T]) -> T:
        """``operation()`` (a call of the store on ``key``), its failure a :class:`StoreError`."""
        try:
            return operation()
        except StoreError:
            raise
        except Exception as error:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError, by store
            raise StoreError(
                f"weight sync {self.name!r}: the store failed to {what} {key!r} ({error}): is its "
                "server (the TCPStore's master process) still up?",
                key,
            ) from error

    def count(self, key: str, step: int, store: dist.Store | None = None) -> int:
        """Add ``step`` to the counter ``key`` (0: read it): its value, checked."""
        store = self.store if store is None else store
        value = self.call("add to", key, lambda: store.add(key, step))
        if not 0 <= value <= MAX_COUNT:
            raise _bad(
                key,
                "a counter",
                f"it holds {value}",
                "delete the key (no sender of the name may run then)",
            )
        return value

    def read(self, key: str, store: dist.Store | None = None) -> bytes | None:
        """The value of ``key``, or None if it is not set (never blocks), at most :data:`MAX_RECORD_BYTES`."""
        store = self.store if store is None else store
        if not self.call("look up", key, lambda: store.check([key])):
            return None
        value = self.call("read", key, lambda: store.get(key))
        if len(value) > MAX_RECORD_BYTES:
            raise _bad(
                key, "a record", f"it holds {len(value)} bytes, more than {MAX_RECORD_BYTES}"
            )
        return value

    def set_once(self, key: str, value: str) -> bytes:
        """Write ``value`` at ``key`` unless it is set already: what ``key`` holds then (ours, or the earlier)."""
        return self.call("write", key, lambda: self.store.compare_set(key, "", value))

    def wait_for(self, key: str, deadline: float, closing: threading.Event) -> bool:
        """Until ``key`` is set (True) or ``deadline`` (monotonic) passes (False); :class:`UsageError` as soon as
        ``closing`` is set (the receiver closed). Looks with ``check``, which never blocks, at growing intervals."""
        interval = POLL_FIRST
        while True:
            if closing.is_set():
                raise UsageError("this WeightReceiver was closed while it waited for its sender")
            if self.call("look up", key, lambda: self.store.check([key])):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            closing.wait(min(interval, left))
            interval = min(interval * 2, POLL_MOST)

    # -- the sender's side -------------------------------------------------------------------------------
    def announce(self, mode: Mode, timeout: float) -> tuple[int, int]:
        """A new generation of the sender (its ``timeout``: how long a receiver's heartbeat may stand still):
        (its number, the last version pushed under the name, by any generation)."""
        generation = self.count(self.key("generation"), 1)
        version = self.count(self.key("version"), 0)
        record = SenderRecord(host_id(), os.getpid(), mode, timeout)
        sender = self.key(f"g{generation}", "sender")
        self.call("write", sender, lambda: self.store.set(sender, record.to_json()))
        # (after the record: a receiver that reads `current` finds the record there)
        self.call(
            "write",
            self.key("current"),
            lambda: self.store.set(self.key("current"), str(generation)),
        )
        return generation, version

    def next_version(self) -> int:
        """The number of the next version pushed under the name (taken: never given again)."""
        return self.count(self.key("version"), 1)

    def newest(self) -> int | None:
        """The generation ``current`` names, or None if it names none (not set, or not a number)."""
        raw = self.read(self.key("current"))
        return None if raw is None else _number(raw)

    def next_join(self, store: dist.Store, generation: int, k: int) -> JoinRecord | None:
        """The record at join ``k`` (on ``store``, the admission thread's own client), waiting up to
        :data:`ADMISSION_WAIT` s for it: None if none came (wait again); :class:`StoreRecordError` if it is not
        cudarecv's. A number taken and never written is marked ``skip`` by the receiver after it, and the sender's
        close writes its own record, so a wait never outlasts a join or a close."""
        key = self.key(f"g{generation}", "join", k)
        try:
            store.wait([key], datetime.timedelta(seconds=ADMISSION_WAIT))
        except Exception:  # noqa: BLE001 - the wait ran out (a DistStoreError or RuntimeError, by store)
            if not self.call("look up", key, lambda: store.check([key])):
                return None
        raw = self.read(key, store)
        assert raw is not None  # (set once, never deleted)
        return JoinRecord.parse(raw, key)

    def close(self, generation: int, k: int, token: str) -> None:
        """Wake the generation's admission thread, waiting for join ``k``: the sender closed (a receiver's
        request written there first wakes it as well)."""
        self.set_once(
            self.key(f"g{generation}", "join", k), JoinRecord("closing", token=token).to_json()
        )

    # -- a receiver's side -------------------------------------------------------------------------------
    def current(self, newer_than: int, timeout: float, closing: threading.Event) -> int:
        """The newest generation above ``newer_than`` whose sender record is there, waiting up to ``timeout`` s for
        the next to announce itself (:class:`UsageError` at once if ``closing`` is set meanwhile)."""
        if not self.wait_for(
            self.key(f"g{newer_than + 1}", "sender"), time.monotonic() + timeout, closing
        ):
            if newer_than:
                raise SenderClosed(
                    f"weight sender {self.name!r}: no new sender came within {timeout:g} s (the last, "
                    f"generation {newer_than}, is gone)"
                )
            raise WaitTimeout(
                f"no weight sender named {self.name!r} came within {timeout:g} s (is the trainer up, "
                "with this store?)"
            )
        named = self.newest()
        newest = named if named is not None and named > newer_than else newer_than + 1
        while newest > newer_than + 1 and self.read(self.key(f"g{newest}", "sender")) is None:
            newest -= 1  # (`current` names a generation with no record: tampered with; the newest that has one)
        return newest

    def sender(self, generation: int) -> SenderRecord:
        """The generation's sender record (host, pid, mode, timeout), checked."""
        key = self.key(f"g{generation}", "sender")
        raw = self.read(key)
        if raw is None:
            raise _bad(key, "a sender's record", "it is missing")
        return SenderRecord.parse(raw, key)

    def join(self, generation: int) -> int:
        """Ask to join ``generation``: this receiver's number in it; :class:`SenderClosed` if it closed.

        The number is taken, then the request written there unless the key is set already: by the sender's close,
        or by the receiver after this one, which marks a number taken and not yet written as skipped (so that a
        receiver that died between the two never holds the sender's admissions up); this one then takes another."""
        mine = JoinRecord("join", host_id(), os.getpid()).to_json()
        for _ in range(JOIN_TRIES):
            k = self.count(self.key(f"g{generation}", "joins"), 1)
            key = self.key(f"g{generation}", "join", k)
            there = self.set_once(key, mine)
            if (
                k > 1
            ):  # (the number before: if it is still unwritten, its receiver died or is late: skip it)
                self.set_once(
                    self.key(f"g{generation}", "join", k - 1), JoinRecord("skip").to_json()
                )
            if there.decode(errors="replace") == mine:
                return k
            if JoinRecord.parse(there, key).kind == "closing":
                raise SenderClosed(
                    f"weight sender {self.name!r} (generation {generation}) closed as this receiver "
                    "asked to join it"
                )
        raise StoreError(
            f"weight sync {self.name!r}: {JOIN_TRIES} join numbers in a row were marked skipped before "
            "this receiver wrote its request (is the store very slow?)",
            self.key(f"g{generation}", "joins"),
        )

    def pair(self, generation: int, k: int) -> str:
        """The prefix on which the sender and receiver ``k`` form their group."""
        return self.key(f"g{generation}", "pair", k)

    def alive(self, generation: int, k: int) -> str:
        return self.key(f"g{generation}", "alive", k)

    def dropped(self, generation: int, k: int) -> str:
        return self.key(f"g{generation}", "dropped", k)

    def edge(self, generation: int, a: int, b: int, version: int) -> str:
        """The prefix on which receivers ``a`` and ``b`` form their pair for the relay chain of ``version``."""
        return self.key(f"g{generation}", "edge", f"{min(a, b)}-{max(a, b)}", version)


def own_client(store: dist.Store, timeout: float | None = None) -> dist.Store:
    """A client of ``store`` of cudarecv's own (TCPStore and FileStore clone; a store that cannot is shared),
    whose calls wait at most ``timeout`` s (a clone's clones too; the caller's own client is left as it is)."""
    try:
        client = store.clone()  # type: ignore[attr-defined]  # torch's stubs lack Store.clone (torch has it)
    except Exception:  # noqa: BLE001 - e.g. a HashStore, in one process: no client to wait behind
        return store
    if timeout is not None:
        client.set_timeout(datetime.timedelta(seconds=timeout))
    return client


def closing_token() -> str:
    """A sender's own token for its closing record (kept in its process only)."""
    return secrets.token_hex(16)


# -- checking records -----------------------------------------------------------------------------------------
def _bad(
    key: str,
    what: str,
    problem: str,
    fix: str = "is another program writing under cudarecv/weights/? Delete the key, or give the sender "
    "another `name`",
) -> StoreRecordError:
    return StoreRecordError(
        f"the store's key {key!r} should hold {what} written by cudarecv, but {problem}: {fix}", key
    )


def _object(raw: bytes, key: str, what: str) -> dict[str, Any]:
    try:
        fields = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _bad(key, what, f"it is not JSON ({bytes(raw[:40])!r})") from None
    if not isinstance(fields, dict):
        raise _bad(key, what, f"it is a JSON {type(fields).__name__}, not an object")
    return fields


def _host(fields: dict[str, Any], key: str, what: str) -> str:
    host = fields.get("host")
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
        raise _bad(
            key,
            what,
            f"its host is {str(host)[:40]!r}, not a name of at most {MAX_HOST_CHARS} characters",
        )
    return host


def _pid(fields: dict[str, Any], key: str, what: str) -> int:
    pid = fields.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= MAX_PID:
        raise _bad(key, what, f"its pid is {str(pid)[:40]!r}, not a process id")
    return pid


def _number(raw: bytes) -> int | None:
    """``raw`` as a count (decimal, 1 to :data:`MAX_COUNT`), or None."""
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value <= MAX_COUNT else None
