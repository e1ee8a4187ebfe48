"""A weight sender's snapshots: the storages a version is copied into before it goes out, shared segments
(host memory or CUDA IPC) where receivers on this machine map them, and which one a push may write.

Sync mode keeps one snapshot, rewritten by every push (three in host shared memory, which a zero-copy
receiver publishes where they lie: each push takes one that no such receiver holds); latest mode keeps
``buffers`` of them (the latest version, those being sent, and free ones). A snapshot a dropped receiver's
send (or copy) may still read is never written again: it is replaced by one of the sender's own (:attr:`torn`),
and the snapshots a zero-copy receiver that left may still read are *retired*, never written again (two
writable ones are kept: new ones are the sender's own, sent on the wire).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core import streams
from ..core.errors import UsageError, WaitTimeout
from ..core.host_copy import CopyTable
from ..plan.header import cut
from .delta import encode, patch_message, word_bytes
from .schema import Schema
from .session import Member, Session
from .wire import PushHeader, checksum

if TYPE_CHECKING:
    from ..plan.plan import Plan


@dataclass(frozen=True)
class Patch:
    """Delta: what turns version ``base`` into a snapshot's version (:mod:`.delta`), as it is sent."""

    base: int
    #: its bytes, and the messages it is sent in
    storage: torch.Tensor
    chunks: list[torch.Tensor]
    header: PushHeader


class Snapshot:
    """One sender-side storage of the weights, with the version it holds and its readers; in a shared segment
    (index ``segment`` of the handshake's offer) when receivers may map it."""

    def __init__(
        self,
        schema: Schema,
        bucket_bytes: int,
        device: torch.device,
        shared: tuple[int, Any] | None = None,
    ) -> None:
        #: its index in the offer, and the transport's segment it lies in (None: the sender's own storage)
        self.segment: int | None = shared[0] if shared is not None else None
        self.shared: Any = shared[1] if shared is not None else None
        self.storage = (
            shared[1].data
            if shared is not None
            else torch.zeros(schema.total, dtype=torch.uint8, device=device)
        )
        self.views = schema.views(self.storage)
        self.chunks = schema.cut(self.storage, bucket_bytes)  # the messages it is sent in
        self._whole = None if schema.leafwise else self.storage
        self.header: PushHeader | None = None
        #: delta, sync mode: the patch from the version pushed before it, if one is smaller than the version
        self.patch: Patch | None = None
        #: delta, latest mode: the patches to the version it holds from each base a receiver asked from (None: no
        #: patch, the version whole), computed once each (under ``diffing``) while it holds this version
        self.patches: dict[int, Patch | None] = {}
        self.diffing = threading.Lock()
        self.readers = 0  # replies in flight that send from it
        self.writing = False
        self.holders = (
            0  # zero-copy receivers that may read it where it lies (sent to them, not yet FREED)
        )
        self.retired = False  # a zero-copy receiver that held it is gone: it may read it still, never write it again
        self._gather: tuple[Plan, CopyTable, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._rung: tuple[PushHeader, bytes] | None = None  # (:meth:`rung`)

    def gather(self, plan: Plan) -> None:
        """Copy host leaves (``plan``'s) into this host storage: the contiguous ones in one native call (one
        thread: the receivers' copies share the cores), the others one by one (a strided piece of a shard, a
        leaf cast to the sender's ``wire_dtype``). The table of copies is kept while the plan is (a plan is
        rebuilt when a leaf's memory moves)."""
        if self._gather is None or self._gather[0] is not plan:
            rows, strided = [], []
            for view, leaf in zip(self.views, plan.detached):
                if not leaf.is_contiguous() or leaf.dtype != view.dtype:
                    strided.append((view, leaf))
                elif leaf.numel():
                    rows.append(
                        (view.data_ptr(), leaf.data_ptr(), view.numel() * view.element_size())
                    )
            self._gather = (plan, CopyTable(rows), strided)
        _, table, strided = self._gather
        table.run(0, len(table))
        for view, leaf in strided:
            view.copy_(leaf)

    @property
    def pushed(self) -> PushHeader:
        """The header of the version it holds: a snapshot goes out only once a version is written in it."""
        assert self.header is not None, "a snapshot is sent before a version is written in it"
        return self.header

    def rung(self) -> bytes:
        """The header a doorbell rings with for the version it holds (shared, naming its segment): packed once per
        version, whichever receivers it goes to (:mod:`cudarecv.samehost.doorbell`)."""
        header = self.pushed
        if self._rung is None or self._rung[0] is not header:
            assert self.segment is not None, "a doorbell rings for a snapshot in no segment"
            raw = dataclasses.replace(header, shared=True, segment=self.segment, bell=True).pack()
            self._rung = (header, raw)
        return self._rung[1]

    def digest(self) -> bytes:
        """BLAKE3 of the version it holds, as sent: its messages in order (``verify``)."""
        return checksum(self.chunks, self._whole)


class SnapshotPool:
    """The snapshots of one sender (see the module docstring); waits and changes under the session's lock."""

    def __init__(self, session: Session, device: torch.device, count: int) -> None:
        self.session, self.device = session, device
        transport = session.transport
        self.segments: list[Any] = transport.segments(session.schema.total, device, count)
        #: what receivers on this machine need to map the snapshots (sent in the handshake)
        self.offer = transport.offer(self.segments)
        self.snapshots = [
            Snapshot(
                session.schema, session.bucket_bytes, device, (i, s) if self.segments else None
            )
            for i, s in enumerate(self.segments or [None] * count)
        ]
        self.latest: Snapshot | None = None
        self.populated = False  # the shared snapshots' pages allocated (once, for the first receiver to map them)
        self.torn = (
            False  # sync: a dropped receiver's send may still read the storage: use a new one
        )
        #: delta: the version pushed last, to diff the next against (allocated at the first push that diffs)
        self.base: Base | None = None
        if session.verify and device.type == "cuda":
            from ..cuda.digest import prepare  # (the digest kernels compiled now, not in a push)

            prepare(device)

    def close_fds(self) -> None:
        """Every receiver that could map the segments has (or none will): nothing names them now."""
        for segment in self.segments:
            segment.close_fd()

    def own(self) -> Snapshot:
        """A storage of the sender's own (a replacement: receivers get what it holds on the wire)."""
        return Snapshot(self.session.schema, self.session.bucket_bytes, self.device)

    def clear(self) -> None:
        self.snapshots, self.latest, self.segments, self.base = [], None, [], None

    # -- which snapshot a push writes -------------------------------------------------------------------
    def _wait(self, find: Callable[[], Snapshot | None], timeout: float) -> Snapshot | None:
        """Under the lock: wait up to ``timeout`` s for ``find()`` to find a snapshot, and return it (None: none
        came in time); raises :class:`UsageError` if the sender is closed meanwhile (by another thread)."""
        came = self.session.cond.wait_for(
            lambda: self.session.closed or find() is not None, timeout=timeout
        )
        if self.session.closed:
            raise UsageError("this WeightSender was closed while a push waited for a free snapshot")
        return find() if came else None

    def sync_target(self, timeout: float) -> Snapshot:
        """Sync mode: the snapshot the next version goes in, the first that no zero-copy receiver holds (waiting
        up to ``timeout`` s for one to let go of one)."""
        if self.torn:  # the old storages stay with the parked sends of the dropped receiver
            self.snapshots, self.torn = [self.own()], False
        with self.session.cond:
            self._replenish()
            target = self._wait(self._unheld, timeout)
            if target is None:
                raise WaitTimeout(
                    f"zero-copy receivers held every shared snapshot for {timeout:g} s "
                    f"((rank, version): {self.session.held()}; a reading() kept across pushes?)"
                )
            return target

    def free_now(self) -> bool:
        """Latest mode: whether :meth:`latest_target` would find a snapshot without waiting."""
        with self.session.cond:
            return self._free() is not None

    def latest_target(self, timeout: float) -> Snapshot:
        """Latest mode: a snapshot that is neither the latest nor being sent, written or held (waiting up to
        ``timeout`` s), marked as being written."""
        with self.session.cond:
            target = self._wait(self._free, timeout)
            if target is None:
                raise WaitTimeout(
                    f"no snapshot buffer of {len(self.snapshots)} was free for {timeout:g} s: "
                    f"{self._busy()}"
                )
            target.writing = True
            return target

    def _unheld(self) -> Snapshot | None:
        return next((s for s in self.snapshots if s.holders == 0 and not s.retired), None)

    def _free(self) -> Snapshot | None:
        """Under the lock: the free snapshot that holds the oldest version (or none yet): the others keep recent
        versions, which delta diffs a receiver's version against."""
        self._replenish()
        free = [
            s
            for s in self.snapshots
            if s is not self.latest
            and s.readers == 0
            and not s.writing
            and s.holders == 0
            and not s.retired
        ]
        return min(
            free, key=lambda s: s.header.version if s.header is not None else -1, default=None
        )

    def _busy(self) -> str:
        """Under the lock: why no snapshot buffer is free (latest mode)."""
        sent, held = sum(s.readers > 0 for s in self.snapshots), self.session.held()
        return (
            f"{sent} being sent, 1 the latest version"
            + (
                f", held by zero-copy receivers ((rank, version): {held}; a reading() kept across pushes?)"
                if held
                else ""
            )
            + "; pass a larger `buffers`"
        )

    def _replenish(self) -> None:
        """Under the lock: keep two snapshots that can be written once zero-copy receivers that left hold others
        forever (new ones are the sender's own, sent on the wire)."""
        while (
            any(s.retired for s in self.snapshots)
            and sum(not s.retired for s in self.snapshots) < 2
        ):
            self.snapshots.append(self.own())

    def replace(self, snapshot: Snapshot) -> None:
        """Under the lock: a failed reply's parked send may still read ``snapshot``: never write it again."""
        self.snapshots[self.snapshots.index(snapshot)] = fresh = self.own()
        if self.latest is snapshot:
            fresh.storage.copy_(snapshot.storage)
            fresh.header = snapshot.header
            self.latest = fresh

    # -- zero-copy holders ------------------------------------------------------------------------------
    def retire(self, member: Member) -> None:
        """``member`` is gone: the snapshots it may still read where they lie are never written again."""
        with self.session.cond:
            for snapshot in member.holding.values():
                snapshot.retired = True
            member.holding.clear()
            self.session.cond.notify_all()

    def let_go(self, member: Member, version: int) -> bool:
        """Under the lock: ``member`` no longer reads the snapshot of ``version``; False if it held none."""
        snapshot = member.holding.pop(version, None)
        if snapshot is None:
            return False
        snapshot.holders -= 1
        self.session.cond.notify_all()
        return True

    # -- writing a version ------------------------------------------------------------------------------
    def copy_in(self, plan: Plan, target: Snapshot, stream: torch.cuda.Stream | None) -> None:
        """Copy the weights (``plan``'s leaves) into ``target`` as the next version (on ``stream`` for GPU
        weights), with its header; the session's version moves on."""
        session = self.session
        if stream is not None:
            streams.follow_caller(stream)
        with (
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
            torch.no_grad(),
        ):
            # the transport of the segment it lies in (none: the sender's own storage)
            lies_in = session.transport if target.shared is not None else None
            if lies_in is not None:
                lies_in.before_write(target.shared, session.version + 1)
            if plan.device.type == "cpu" and target.storage.device.type == "cpu":
                target.gather(plan)
            else:
                torch._foreach_copy_(
                    target.views, plan.detached, non_blocking=True
                )  # never an autograd node
            digest = target.digest() if session.verify else bytes(16)
            if lies_in is not None:  # (receivers check its stamps, or wait for its event)
                lies_in.after_write(target.shared, session.version + 1, stream)
        if stream is not None:  # the caller's next writes (an optimizer step) wait for the copy
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        session.version += 1
        target.header = PushHeader(
            session.version,
            session.schema.total,
            session.bucket_bytes,
            session.schema.fingerprint,
            digest,
            session.verify,
            ack=session.delta,
        )
        target.patch, target.patches = None, {}

    def patch_from(self, snapshot: Snapshot, held: int | None) -> Patch | None:
        """Delta, latest mode (on a reply's thread): the patch that turns version ``held``, which a receiver holds,
        into ``snapshot``'s, if a snapshot of the pool still holds ``held`` and the patch is smaller than the
        version; computed once per base while ``snapshot`` holds its version (replies to receivers on the same
        base share it). The base's snapshot is read while no push may write it (it counts as being sent)."""
        header = snapshot.pushed
        if held is None or held >= header.version:
            return None
        with snapshot.diffing:
            if held in snapshot.patches:
                return snapshot.patches[held]
            with self.session.cond:
                base = next(
                    (
                        s
                        for s in self.snapshots
                        if s.header is not None and s.header.version == held and not s.writing
                    ),
                    None,
                )
                if base is None:
                    return None  # (overwritten since: the version whole)
                base.readers += 1
            try:
                patch = encode(snapshot.storage, base.storage, word_bytes(self.session.schema))
            finally:
                with self.session.cond:
                    base.readers -= 1
                    self.session.cond.notify_all()
            snapshot.patches[held] = found = (
                None if patch is None else _patch(self.session, header, held, patch)
            )
            return found

    def diff(self, target: Snapshot, stream: torch.cuda.Stream | None) -> None:
        """Delta, once ``target`` holds the new version: its patch from the version before (``target.patch``; None
        if the base is not that version or a patch would not be smaller), and the base moves on to it."""
        if self.base is None:
            self.base = Base(self.session, self.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            target.patch = self.base.advance(target)

    def forget_base(self) -> None:
        """Delta: no receiver takes patches now (none on the wire): stop diffing, and let go of the base."""
        self.base = None


class Base:
    """Delta, a sender's (sync mode): the version it pushed last (its bytes), and the buffer a patch from it is
    written in (as large as the largest patch so far)."""

    def __init__(self, session: Session, device: torch.device) -> None:
        total = session.schema.total
        self.session, self.word = session, word_bytes(session.schema)
        self.storage = torch.zeros(total, dtype=torch.uint8, device=device)
        self.version = 0  # (0: none yet)
        self._out: torch.Tensor | None = (
            None  # the patch's buffer: as large as the largest patch so far
        )

    def advance(self, target: Snapshot) -> Patch | None:
        """``target``'s patch from the base (None: the base holds no version before it, or the patch would not be
        smaller); the base then holds ``target``'s version. The patch lies in this base's buffer: the push that
        sends it is over before the next one diffs (sync mode)."""
        header = target.pushed
        if self.version != header.version - 1 or self.version == 0:
            self.storage.copy_(target.storage)
            self.version = header.version
            return None
        patch = encode(target.storage, self.storage, self.word, self._out, advance=True)
        self.version = header.version
        if patch is not None and (self._out is None or patch.data_ptr() != self._out.data_ptr()):
            self._out = patch  # (a new, larger one)
        return None if patch is None else _patch(self.session, header, header.version - 1, patch)


def _patch(session: Session, header: PushHeader, base: int, patch: torch.Tensor) -> Patch:
    """``patch`` (from version ``base`` to ``header``'s) with its messages and header."""
    return Patch(
        base,
        patch,
        cut(patch, patch_message(session.bucket_bytes)),
        dataclasses.replace(header, base=base, patch=patch.numel()),
    )
