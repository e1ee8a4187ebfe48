"""The actor's end of a weight sync: :class:`WeightReceiver`.

The receiver keeps two storages: the published one (``receiver.td``, the last
complete, verified version) and the one the next pull lands in. A pull that
fails (timeout, wrong header, digest mismatch, dead sender) never touches the
published one; a late write from an abandoned transfer can only land in the
other, which is never published after such a failure (the receiver is then
marked broken: close it and connect a new one).

With ``zero_copy=True`` and a sender on this machine (host weights), a version
is published where it lies in the sender's shared snapshot (mapped read-only) and
nothing is copied: the sender writes that snapshot again only once this receiver
has said ``FREED`` (a newer version published, no reader left on the old one).

On gloo the receiver always has the next header receive posted (on its own
thread), so a sender that closes is heard at once, even between pulls, and a
pull waits for a version as long as its caller likes without breaking the
link: only once a version starts to arrive does the pull's own clock run.

With a relay sender (``fanout="relay"``) the payload comes from the receiver
before this one in the chain, and is forwarded to the one after it as it lands
(:mod:`cudarecv.weights.relay`); the API is the same, and a version is published only once it
fully landed here and passed this receiver's own checks.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Iterator

import torch
from tensordict import TensorDict
from torch import Tensor

from ..core import streams
from ..core.checks import check_timeout
from ..core.driver import Driver
from ..core.errors import (
    ArgumentError,
    BrokenError,
    ChecksumError,
    Error,
    OutOfStepError,
    PeerError,
    PushHeaderError,
    ReceiverFailed,
    SchemaError,
    SenderClosed,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from ..core.host_copy import copy_bytes
from ..core.link import Link, resolve
from ..core.tags import TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS
from ..core.transfer import CUDA_IPC, SHARED_MEMORY, WIRE, StartClock, Transfer
from ..plan.header import check_pieces, cut
from ..plan.walk import unwrap, walk
from ..samehost import cuda_ipc
from ..samehost.machine import host_id
from ..samehost.policy import allowed
from ..samehost.shared_memory import MAX_SEGMENTS, MappingError, map_offer, offer_size
from ..wire.control import read_bytes, wire_bytes
from ..wire.staging import Lane, drain, lane_for, recv_into, send_from, wire_can_touch
from .link import Unanswered, link_error, naming, run, send_bytes
from .options import check_options
from .relay import Relay
from .wire import (
    ACCEPTED,
    ASK,
    BROKEN,
    BYE,
    CLOSED,
    FAILED,
    FREED,
    GOT,
    HEADER_SIZE,
    LANDED,
    LOST,
    PREAMBLE_SIZE,
    PUSH,
    REFUSED,
    REJECTED,
    RELEASED,
    TRAILER_SIZE,
    Offer,
    PushHeader,
    Schema,
    SessionTags,
    ask_message,
    check_offer,
    checksum,
    read_preamble,
    read_trailer,
    status_message,
)


class _Slot:
    """One storage the receiver can publish, with its tensordict of views and readers: its own, or
    (``storage`` given, zero-copy) the sender's shared snapshot, mapped read-only."""

    def __init__(self, schema: Schema, piece: int, device: torch.device, pin_memory: bool,
                 storage: Tensor | None = None) -> None:
        self.alias = storage is not None
        if storage is None:
            storage = torch.zeros(schema.total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        self.storage = storage
        self.version: int | None = None  # an alias: the version it holds, until the sender is told it is FREED
        views = schema.views(self.storage)
        self.td = TensorDict({l.key: v for l, v in zip(schema.leaves, views)}, batch_size=[]).lock_()
        if len(self.td.keys(True, True)) != len(schema.leaves):
            raise SchemaError("the schema's keys do not make one leaf each")
        self.pieces = cut(self.storage, piece)
        self.readers = 0


def _expected(expect: Any) -> tuple[list[tuple], list[Tensor]]:
    if isinstance(expect, torch.nn.Module):
        named = list(expect.named_parameters()) + list(expect.named_buffers())
        return [tuple(n.split(".")) for n, _ in named], [t for _, t in named]
    paths, tensors = walk(unwrap(expect))
    return [tuple(map(str, p)) for p in paths], tensors


def _header_too_long(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (not drained, the link is out of step)")


def _answer_lane(link: Link) -> Lane | None:
    """A lane to answer the handshake on when the receiver's own could not be built."""
    if link.backend != "nccl":
        return Lane(link)
    if not torch.cuda.is_available():
        return None  # NCCL without CUDA cannot carry an answer: the sender's timeout tells it
    return lane_for(link, torch.device("cuda", torch.cuda.current_device()), None, streams.StagingPool())


class WeightReceiver:
    """Receive the versions a :class:`WeightSender` pushes; ``td`` is the latest complete one.

    Keyword Args:
        src / group_src: the sender's rank (global, or in ``group``); exactly one.
        group: the process group (a standalone one with ``group_src``).
        device: where the weights live (``"cpu"`` default, or a CUDA device).
        pin_memory: page-locked host storage (CPU only).
        expect: a tensordict or an ``nn.Module`` the weights must match (keys,
            shapes, dtypes); a mismatch raises :class:`SchemaError` naming the
            first differing key, and the sender's construction fails too.
        timeout: seconds any wait may take.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).
        transport: ``"auto"`` (map a same-host sender's snapshots if offered) or ``"wire"``;
            :attr:`transport` says which was taken.
        zero_copy: through shared memory (host weights, a sender on this machine), publish each
            version where the sender's snapshot lies instead of copying it out: a pull costs no
            copy at all, and :attr:`td`'s tensors are views of memory mapped *read-only* (writing to
            them kills the process with SIGSEGV: copy what you must change, or use :meth:`load_into`).
            The sender writes a snapshot again only once this receiver let go of it (a newer version
            published and no :meth:`reading` left on it). :attr:`zero_copy` says whether it is in use
            (on other transports versions are copied as without it).

    Whatever makes the construction fail once the link is resolved (a bad
    argument, no CUDA, no memory, ``expect`` not matching, a malformed schema)
    is sent back as the handshake's answer, so the sender fails at once too,
    with this receiver's reason. The sender's mode (``sync`` or ``latest``)
    comes with the handshake (:attr:`mode`); the receiver's API is the same.

    Example:
        >>> receiver = WeightReceiver(src=0, device="cuda:0", expect=policy)
        >>> receiver.pull()              # blocks until a new version has landed
        >>> receiver.load_into(policy)   # or read receiver.td
    """

    def __init__(self, src: int | None = None, *, group: Any = None, group_src: int | None = None,
                 device: Any = None, pin_memory: bool = False, expect: Any = None, timeout: float = 60.0,
                 stream: Any = None, transport: str = "auto", zero_copy: bool = False) -> None:
        self.timeout = 60.0  # until checked: the time given to answer the sender
        try:
            self.timeout = check_options(timeout=timeout, transport=transport, zero_copy=zero_copy)["timeout"]
            if zero_copy and pin_memory:
                raise ArgumentError("`zero_copy=True` publishes the sender's shared snapshots, which are not "
                                    "page-locked: drop `pin_memory=True` or `zero_copy`")
            try:
                self._device = streams.explicit(device if device is not None else "cpu")  # (threads use it)
            except (RuntimeError, TypeError) as error:
                raise ArgumentError(f"`device` must name a device (\"cpu\", \"cuda:0\"), got {device!r}: "
                                    f"{error}") from None
            if pin_memory and self._device.type != "cpu":
                raise ArgumentError(f"`pin_memory=True` is for host memory, but `device` is {self._device}: "
                                    "drop one")
            problem = None
        except Exception as error:  # noqa: BLE001 - raised below, after the sender is told
            problem = error
        try:
            link = resolve(src, group_src, group, "src", "group_src")  # before this, nobody to answer
        except Exception:
            if problem is not None:
                raise problem from None
            raise
        try:
            if problem is not None:
                raise problem
            self._lane = lane_for(link, self._device, stream, streams.StagingPool())
        except Exception as error:
            _refuse(link, self.timeout, error)
            raise
        self.schema, self._piece, offer, self._slots, self._mappings = _handshake(
            self._lane, self.timeout, expect,
            lambda schema, piece: [_Slot(schema, piece, self._device, pin_memory) for _ in range(2)],
            allow=allowed(transport), device=self._device, zero_copy=zero_copy and self._device.type == "cpu")
        #: what carries the versions: ``"shared memory"`` (the sender's snapshots, mapped read-only: this
        #: receiver is on the sender's machine), ``"cuda ipc"`` (its GPU snapshots, opened once) or ``"wire"``
        self.transport = WIRE if not self._mappings else (
            CUDA_IPC if isinstance(self._mappings[0], cuda_ipc.DeviceMapping) else SHARED_MEMORY)
        #: whether versions are published where they lie in the sender's shared snapshots (no copy; see ``zero_copy``)
        self.zero_copy = zero_copy and self.transport == SHARED_MEMORY and self._device.type == "cpu"
        self._aliases = [_Slot(self.schema, self._piece, self._device, False, m.data[:self.schema.total])
                         for m in self._mappings] if self.zero_copy else []
        #: the sender's mode, learnt in the handshake: ``"sync"`` or ``"latest"``
        self.mode = offer.mode
        self._tags = SessionTags.of(offer.session)
        #: this receiver's words to the sender, until the sender shows it took them
        self._asks = Unanswered(self._lane, self._tags.ask)
        self._answered = 0  # the mark of the last GOT: a sync sender's next push shows it took it
        self._cond = threading.Condition()
        self._published: _Slot | None = None
        self._pending: Transfer | None = None  # the pull under way (one at a time)
        self._broken: str | None = None
        self._closed = False
        self._pulling = False  # a thread's pull is under way: another's waits for its turn
        self._sender_closed: str | None = None
        self._released = False  # the sender answered our BYE
        self._bye = False  # BYE sent (once)
        self._driver = Driver(f"cudarecv-pull-{link.peer}")  # drives every receive (the caller keeps the time)
        # relay fan-out: lanes to the other receivers, a forwarding thread per next hop, and per slot the
        # forward that may still read it; while a relayed payload arrives: its relay and upstream link
        self._peers: dict[int, Lane] = {}
        self._forwarders: dict[int, Driver] = {}
        self._forwards: dict[int, Transfer] = {}
        self._relaying: tuple[Relay | None, Link, int] | None = None
        self._lost_at: int | None = None
        self.version = 0
        # gloo: the next header receive is always posted, so the sender's CLOSED is heard at once. NCCL runs a
        # pair's sends and receives in order on one stream: there a pull posts its header receive itself.
        self._standing = self._listen() if link.backend != "nccl" else None

    # -- reading ------------------------------------------------------------------------
    @property
    def buffer_count(self) -> int:
        """How many distinct tensordicts :attr:`td` and :meth:`reading` hand out in turn: this receiver's two
        buffers, plus the sender's snapshots with :attr:`zero_copy` (a cache of views needs no more entries)."""
        return len(self._slots) + len(self._aliases)

    @property
    def td(self) -> TensorDict:
        """The latest complete, verified version (a locked tensordict of views).

        Readable from the first successful pull on, also after :meth:`close`, after the
        sender closed and after a failed pull; :meth:`reading` holds it against the next pull.
        """
        if self._published is None:
            raise UsageError("no version has landed yet: call pull() first")
        return self._published.td

    @contextlib.contextmanager
    def reading(self) -> Iterator[TensorDict]:
        """Hold the latest version while reading it: no pull writes into it meanwhile.

        Example:
            >>> with receiver.reading() as td:
            ...     action = policy_from(td)(obs)
        """
        with self._cond:
            if self._published is None:
                raise UsageError("no version has landed yet: call pull() first")
            slot = self._published
            slot.readers += 1
        try:
            yield slot.td
        finally:
            with self._cond:
                slot.readers -= 1
                if slot.alias and slot.readers == 0 and slot is not self._published:
                    self._free(slot)
                self._cond.notify_all()

    # -- pulling ------------------------------------------------------------------------
    def pull(self, wait: bool = True, timeout: float | None = None) -> int | Transfer:
        """Receive a version newer than the one held; return its number once it has landed
        and been verified.

        In ``sync`` mode that is the next version pushed; in ``latest`` mode the
        newest one complete when the pull asks (the ones missed are skipped), and the
        pull waits only while the receiver already holds the newest.

        ``timeout``: seconds this pull may take (default: the receiver's ``timeout``).
        While no version has started to arrive, running out raises
        :class:`WaitTimeout` and the pull goes on: the next ``pull()`` carries on with
        it. Once a version arrives, it must land within ``timeout``.

        With ``wait=False``, return a :class:`~cudarecv.Transfer` whose ``wait()``
        returns the version; it is driven to its end on the receiver's own thread,
        and a ``wait(t)`` that runs out never fails it (the pull goes on).

        Pulls from several threads take turns, each getting a whole version newer than the
        one before: a pull first waits up to ``timeout`` for another thread's pull to end
        (``WaitTimeout``).

        Raises:
            SenderClosed: the sender closed (at once, also between pulls); the last
                version stays readable.
            PushHeaderError / ChecksumError: the push was rejected and drained; the
                last version stays published and the next pull works.
            OutOfStepError: a message that is no push of this handshake (lengths,
                not a header); TransferTimeout / PeerError: a version did not land
                within ``timeout``, or the sender died. After these the receiver is
                broken (:class:`BrokenError` from then on): close it and connect a
                new one.
        """
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        limit = self.timeout if timeout is None else check_timeout(timeout)
        with self._turn(limit):
            return self._pull_in_turn(wait, limit)

    @contextlib.contextmanager
    def _turn(self, limit: float) -> Iterator[None]:
        """Pulls from several threads take turns: wait up to ``limit`` s for another thread's pull to end
        (its own timeout bounds it); ``close()`` ends the wait at once."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or not self._pulling, timeout=limit):
                raise WaitTimeout(f"another thread's pull held this WeightReceiver for {limit:g} s (pulls from "
                                  "several threads take turns)")
            if self._closed:
                raise UsageError("this WeightReceiver closed while a pull waited for another thread's pull")
            self._pulling = True
        try:
            yield
        finally:
            with self._cond:
                self._pulling = False
                self._cond.notify_all()

    def _pull_in_turn(self, wait: bool, limit: float) -> int | Transfer:
        """:meth:`pull`, in this thread's turn."""
        if self._broken:
            raise BrokenError(f"this WeightReceiver is broken ({self._broken}): close it and connect a new one")
        transfer = self._pending
        if transfer is None or transfer.settled:  # else: a pull under way (wait=False, or a wait that ran out)
            transfer = self._pending = self._start_pull(limit)
        if not wait:
            return transfer
        try:
            return transfer.wait(limit)
        except WaitTimeout:
            if transfer.timeout != math.inf:  # a version is arriving: its own clock bounds the rest
                return transfer.wait()
            raise WaitTimeout(self._waited(limit)) from None

    def _waited(self, limit: float) -> str:
        hint = ("the sender has pushed nothing newer yet" if self.mode == "latest"
                else "the sender pushed nothing: is it still pushing, to this rank?")
        return (f"pull from rank {self._lane.link.peer}: no version newer than {self.version} began to arrive "
                f"within {limit:g} s ({hint}); the pull goes on: the next pull() carries on waiting")

    def _start_pull(self, limit: float) -> Transfer:
        if self._sender_closed:
            raise SenderClosed(f"{self._sender_closed}; version {self.version} stays readable in receiver.td")
        index = 1 if self._published is self._slots[0] else 0
        forward = self._forwards.pop(index, None)
        if forward is not None:  # relay: the forward of an earlier version may still read this slot
            with contextlib.suppress(Exception):
                forward.wait()  # bounded by its own timeout
            if forward.failed:  # a parked send may read it for as long as it likes: never write it again
                self._slots[index] = _Slot(self.schema, self._piece, self._device,
                                           self._slots[index].storage.is_pinned())
        back = self._slots[index]
        with self._cond:
            if not self._cond.wait_for(lambda: back.readers == 0, timeout=limit):
                raise WaitTimeout(f"a reader held the spare weights buffer for {limit:g} s")
        if self._lane.stream is not None:
            streams.follow_caller(self._lane.stream)
        link = self._lane.link
        return Transfer(self._pull(back, limit), self._lane.stream, timeout=math.inf, driver=self._driver.submit,
                        on_error=lambda error, elapsed: self._on_error(error, elapsed, limit, link),
                        link=self._lane.link, raise_first=False,
                        what=f"pull of a version newer than {self.version} from rank {self._lane.link.peer}")

    def _on_error(self, error: BaseException, elapsed: float, timeout: float, link: Link) -> BaseException:
        relaying, self._relaying = self._relaying, None
        if relaying is not None:  # the relayed payload did not come: tell the next hop and the sender who failed
            relay, link, version = relaying  # the error is the upstream link's
            lost = self._lost_at if self._lost_at is not None else link.peer
            if relay is not None:
                relay.end(broken=lost)
            with contextlib.suppress(Exception):
                self._asks.post(ask_message(GOT, version, LOST, lost))
        if isinstance(error, Error) and error.link_usable:
            return error  # drained, the link in step (or the sender closed): the next pull is told
        if isinstance(error, OutOfStepError):
            self._broken = str(error)
            return error
        seconds = timeout if isinstance(error, TimeoutError) else elapsed
        replaced = error if isinstance(error, Error) and not isinstance(error, TimeoutError) else link_error(
            link, "pull", error, seconds, "sent no complete version")
        self._broken = str(replaced)
        return replaced

    def _listen(self) -> Transfer:
        """Post the next header receive; its transfer waits as long as the sender likes."""
        transfer = Transfer(self._next_header(), self._lane.stream, timeout=math.inf, driver=self._driver.submit,
                            link=self._lane.link, raise_first=False,
                            on_error=naming(self._lane.link, "weight sync", math.inf, "sent nothing"),
                            what=f"the next weight-sync header from rank {self._lane.link.peer}")
        return transfer  # a wait still blocked at exit is ended by the exit hook (cudarecv.core.transfer)

    def _next_header(self) -> Any:
        lane = self._lane  # bound now: close() lets go of it
        raw = yield from read_bytes(lane, HEADER_SIZE, self._tags.header, "weight-push header", _header_too_long)
        header = PushHeader.unpack(raw)
        if header.kind == CLOSED:
            self._sender_closed = f"the sender (rank {lane.link.peer}) closed after version {header.version}"
            if self._claim_bye():
                self._asks.post(ask_message(BYE))  # its listener ends
        elif header.kind == RELEASED:
            self._released = True
        return header

    def _claim_bye(self) -> bool:
        with self._cond:
            first, self._bye = not self._bye, True
            return first

    def _header(self) -> Any:
        """A sub-protocol: the next header (the standing receive's, or one posted now on NCCL)."""
        if self._standing is None:
            raw = yield from read_bytes(self._lane, HEADER_SIZE, self._tags.header, "weight-push header", _header_too_long)
            return PushHeader.unpack(raw)
        standing = self._standing
        yield [standing.ended()]
        yield ()  # (a failed transfer keeps its last works: not the standing receive, nor its group)
        header = standing.wait()  # raises what the standing receive met (a dead sender, a lie)
        if header.kind == PUSH:
            self._standing = self._listen()  # the next one, already
        return header

    def _pull(self, slot: _Slot, limit: float) -> Any:
        lane = self._lane
        # the words the sender has taken once this pull's push comes: in latest mode those before our ASK
        # (its listener reads them in order), in sync mode those up to our last GOT (its push waited for it)
        mark = self._asks.mark() if self.mode == "latest" else self._answered
        if self.mode == "latest":  # ask for a version newer than ours
            asked = yield from send_from(lane, [wire_bytes(lane, ask_message(ASK, self.version))], [self._tags.ask],
                                         defer=True)
            if asked:
                yield asked
        header = yield from self._header()
        if header.kind == CLOSED:
            raise SenderClosed(f"{self._sender_closed}; version {self.version} stays readable in receiver.td")
        if header.kind == RELEASED:
            raise UsageError("this WeightReceiver closed while the pull waited")
        taken = self._asks.taken(mark)
        if taken:
            yield taken  # (returns at once) and lets them go
        yield [StartClock(limit)]  # a version is arriving: it must land within the pull's timeout
        total, piece = self.schema.total, self._piece
        if (header.total, header.piece) != (total, piece):  # never sized from the header
            raise OutOfStepError(
                f"a push of {header.total} bytes in {header.piece}-byte messages does not match the handshake "
                f"({total} bytes in {piece}-byte messages): not drained, the link is out of step"
            )
        problem = None
        if header.fingerprint != self.schema.fingerprint:
            problem = (f"a push with fingerprint {header.fingerprint.hex()} does not match the handshake "
                       f"({self.schema.fingerprint.hex()})")
        elif header.version <= self.version:
            problem = f"version {header.version} is not newer than the current {self.version}"
        if header.shared:
            slot = yield from self._take_shared(header, slot, problem)
        elif header.relayed:
            yield from self._relayed(header, slot, limit)  # forwarded on, whether or not it is published here
        elif problem:
            yield from drain(lane, total, piece, self._tags.payload)
        else:
            yield from recv_into(lane, slot.pieces, [self._tags.payload] * len(slot.pieces))
        if problem:
            self._tell(header, REJECTED)
            raise PushHeaderError(f"{problem}: rejected and drained; version {self.version} stays published")
        if lane.stream is not None:
            yield [streams.EventWork(streams.record(lane.stream))]  # verify and publish landed bytes only
        if header.verify:
            with torch.cuda.stream(lane.stream) if lane.stream is not None else contextlib.nullcontext():
                got = checksum(slot.storage)
            if got != header.checksum:
                self._tell(header, REJECTED)
                raise ChecksumError(
                    f"version {header.version} arrived corrupted (BLAKE3 {got.hex()} != {header.checksum.hex()}): "
                    f"rejected; version {self.version} stays published"
                )
        self._publish(slot, header.version)
        self._tell(header, LANDED)
        return header.version

    def _publish(self, slot: _Slot, version: int) -> None:
        """Make ``slot`` the published version; a zero-copy snapshot published before is let go of
        (the sender may write it again) unless a reader still holds it (then once the last one leaves)."""
        with self._cond:
            previous, self._published = self._published, slot
            slot.version, self.version = version, version
            if previous is not None and previous is not slot and previous.alias and previous.readers == 0:
                self._free(previous)
            self._cond.notify_all()

    def _free(self, alias: _Slot) -> None:
        """Under the lock: tell the sender that this receiver no longer reads ``alias`` (its snapshot)."""
        version, alias.version = alias.version, None
        if version is not None and self._lane is not None:
            with contextlib.suppress(Exception):  # a sender gone: nothing is written there any more
                self._asks.post(ask_message(FREED, version))

    def _take_shared(self, header: PushHeader, slot: _Slot, problem: str | None) -> Any:
        """A sub-protocol: take a shared push's version from the sender's snapshot (the segment the header
        names, checked against the handshake; not when ``problem``: a rejected push) and return the slot to
        publish: ``slot`` with the version copied into it, or (zero-copy) the snapshot itself. Raises if a
        write of a newer version overtook the copy, or overwrote the snapshot (the stamps of :mod:`cudarecv.samehost.shared_memory`)."""
        lane, total = self._lane, self.schema.total
        if not 0 <= header.segment < len(self._mappings):
            raise OutOfStepError(f"a push names shared segment {header.segment}, but the handshake mapped "
                                 f"{len(self._mappings)}: the link is out of step")
        if problem is not None:
            return slot
        mapping = self._mappings[header.segment]  # (its capacity is the schema's total: checked at the handshake)
        if isinstance(mapping, cuda_ipc.DeviceMapping):
            mapping.before_read(lane.stream)
            with lane.on_stream():
                slot.storage.copy_(mapping.data[:total], non_blocking=True)
            return slot
        if self.zero_copy:
            alias = self._aliases[header.segment]
            with self._cond:
                if alias.version is not None or alias.readers:
                    raise OutOfStepError(f"a push of version {header.version} names shared segment "
                                         f"{header.segment}, which this zero-copy receiver still holds (version "
                                         f"{alias.version}): the link is out of step")
            if not mapping.written() == mapping.writing() == header.version:
                raise TransferTimeout(f"the sender's shared snapshot does not hold version {header.version} "
                                      f"whole (the sender stopped waiting for this receiver: it was too slow); "
                                      f"version {self.version} stays published")
            return alias
        written = mapping.written()
        if lane.stream is None:  # one thread's memcpy: actors on this machine share its cores with the trainer
            copy_bytes(slot.storage, mapping.data[:total])
        else:
            with lane.on_stream():
                slot.storage.copy_(mapping.data[:total], non_blocking=True)
            yield [streams.EventWork(streams.record(lane.stream))]  # over before the stamp is read
        if not written == mapping.writing() == header.version:
            raise TransferTimeout(
                f"version {header.version} was overwritten in the sender's shared snapshot before this receiver "
                f"had copied it (the sender stopped waiting for this receiver: it was too slow); version "
                f"{self.version} stays published")
        return slot

    def _tell(self, header: PushHeader, status: int) -> None:
        """Relay fan-out or shared memory: tell the sender what became of the push (its blocking push waits
        for every word; a shared snapshot is not written again before it)."""
        if header.relayed or header.shared:
            self._answered = self._asks.post(ask_message(GOT, header.version, status))

    # -- relay fan-out ------------------------------------------------------------------
    def _relayed(self, header: PushHeader, slot: _Slot, limit: float) -> Any:
        """A sub-protocol: receive the payload from the hop before this one into ``slot`` and forward
        each chunk to the hop after it as it lands; raises :class:`PeerError` naming the rank that
        failed upstream if the push broke there."""
        up = self._peer(header.up, "the hop before this receiver")
        relay = None
        if header.down >= 0:
            if header.down == header.up:
                raise OutOfStepError(f"a relay header names rank {header.up} as both hops: the link is out of step")
            down = self._peer(header.down, "the hop after this receiver")
            relay = Relay(down, slot.pieces, self._tags.payload, self._tags.trailer, header.version)
            self._forwards[self._slots.index(slot)] = Transfer(
                relay.forward(), down.stream, timeout=limit, driver=self._forwarder(header.down).submit,
                link=down.link, raise_first=False, what=f"forward of version {header.version} to rank {header.down}")
        self._relaying, self._lost_at = (relay, up.link, header.version), None
        tags = [self._tags.payload] * len(slot.pieces)
        if relay is not None and up.nccl and wire_can_touch(up, slot.pieces):  # one chunk at a time: each forwarded
            for i, piece in enumerate(slot.pieces):                              # once its receive is on the stream
                yield from recv_into(up, [piece], tags[:1], landed=lambda _, i=i: relay.landed(i))
        else:
            yield from recv_into(up, slot.pieces, tags, landed=relay.landed if relay is not None else None)
        status, version, rank = read_trailer((yield from read_bytes(up, TRAILER_SIZE, self._tags.trailer,
                                                                    "relay trailer", _header_too_long)))
        if version != header.version:
            raise OutOfStepError(f"the relay trailer is for version {version}, not {header.version}: out of step")
        if status == BROKEN:
            self._lost_at = rank
            raise PeerError(f"pull of version {header.version}: rank {rank} before this receiver in the relay chain "
                            f"failed during the push (did its process die?): version {self.version} stays published")
        self._relaying = None
        if relay is not None:
            relay.end()

    def _peer(self, rank: int, what: str) -> Lane:
        """The lane to another rank of this receiver's group (the sender's own for the sender)."""
        link = self._lane.link
        if rank == link.peer:
            return self._lane
        if not 0 <= rank < link.pg.size() or rank == link.pg.rank():
            raise OutOfStepError(f"a relay header names rank {rank} as {what}, in a group of {link.pg.size()} "
                                 f"where this is rank {link.pg.rank()}: the link is out of step")
        lane = self._peers.get(rank)
        if lane is None:
            peer = Link(link.pg, rank, link.registered, link.backend)
            stream = None
            if self._lane.stream is not None:  # forwards run on a stream of their own, next to the receives
                stream = torch.cuda.Stream(device=self._lane.stream.device)
            lane = self._peers[rank] = lane_for(peer, self._device, stream, streams.StagingPool())
        return lane

    def _forwarder(self, rank: int) -> Driver:
        driver = self._forwarders.get(rank)
        if driver is None:
            driver = self._forwarders[rank] = Driver(f"cudarecv-forward-{rank}")
        return driver

    # -- copying out --------------------------------------------------------------------
    def load_into(self, module: torch.nn.Module, strict: bool = True) -> int:
        """Copy the latest version into ``module``'s parameters and buffers, in place.

        Every name is matched and checked before anything is written; returns the
        version copied. With ``strict=False``, names missing on either side are skipped.
        """
        named = list(module.named_parameters()) + list(module.named_buffers())
        with self.reading() as td:
            pairs, missing = [], []
            for name, tensor in named:
                source = td.get(tuple(name.split(".")), None)
                if source is None:
                    missing.append(name)
                    continue
                if source.shape != tensor.shape or source.dtype != tensor.dtype:
                    raise SchemaError(f"{name!r}: received {source.dtype} {list(source.shape)}, "
                                      f"module has {tensor.dtype} {list(tensor.shape)}")
                pairs.append((tensor, source))
            extra = len(td.keys(True, True)) - len(pairs)
            if strict and (missing or extra):
                raise SchemaError(f"load_into: module names not received: {missing}; "
                                  f"{extra} received leaves not in the module (pass strict=False to skip)")
            with torch.no_grad():
                for tensor, source in pairs:
                    tensor.copy_(source, non_blocking=True)
            if any(s.device.type == "cpu" and t.device.type == "cuda" for t, s in pairs):
                # a copy out of host memory may still be queued: finish it before the
                # next pull may write into that memory
                torch.cuda.current_stream(next(t for t, _ in pairs if t.device.type == "cuda").device).synchronize()
            return self.version

    # -- ending -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop receiving and tell the sender, which stops sending to this rank. Idempotent.

        What the sender still has in flight to this rank is taken and dropped, until
        the sender's answer (all within ``timeout``); the published version stays
        readable. A pull still under way ends with :class:`UsageError`.
        """
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # a pull waiting for another thread's ends now
        deadline = time.monotonic() + self.timeout
        self._keep_own_copy()
        if self._standing is not None and not self._broken and not self._sender_closed and self._claim_bye():
            bye = self._asks.post(ask_message(BYE))
            with contextlib.suppress(Exception):
                Transfer(self._farewell(), self._lane.stream, timeout=self.timeout, driver=self._driver.submit,
                         link=self._lane.link, raise_first=False).wait()
            if self._released:  # the sender answered BYE, so it took it and every word before: waited at once
                for work in self._asks.taken(bye):  # (parked, they kept the group's gloo context until exit)
                    work.wait()
            if self._relaying is not None and self._relaying[0] is not None:  # a relay cut short: say so downstream
                self._relaying[0].end(broken=self._relaying[1].peer)
        self._driver.stop(0.0 if self._broken else max(deadline - time.monotonic(), 0.0))
        for forward in self._forwards.values():  # the hops after this one get what is on its way
            with contextlib.suppress(Exception):
                forward.wait(max(deadline - time.monotonic(), 0.0))
        for driver in self._forwarders.values():
            driver.stop(max(deadline - time.monotonic(), 0.0))
        # let go of the process group: a group kept alive past destroy_process_group() by objects in
        # reference cycles is destroyed at interpreter exit, where gloo aborts the process
        self._asks.forget()
        self._standing = self._pending = self._lane = None
        self._peers, self._forwards = {}, {}

    def _keep_own_copy(self) -> None:
        """Zero-copy, on close: copy the published version out of the sender's snapshot into this receiver's
        own memory and let go of the snapshot (unless a reader holds it: the sender then never writes it again)."""
        with self._cond:
            alias = self._published
            if alias is None or not alias.alias or alias.readers or self._pending is not None and not self._pending.settled:
                return
            own = self._slots[0]
            if own.readers:
                return
            copy_bytes(own.storage, alias.storage)
        self._publish(own, alias.version)

    def _farewell(self) -> Any:
        """Take what the sender still sends (a push in flight: drained) until its answer to BYE."""
        lane = self._lane  # bound now: close() lets go of it
        if self._pending is not None and not self._pending.settled:
            yield [self._pending.ended()]
        while not (self._released or self._sender_closed or self._broken):
            header = yield from self._header()
            if header.kind == PUSH and header.relayed:  # the hops after this one still need it
                yield from self._relayed(header, self._slots[1 if self._published is self._slots[0] else 0],
                                         self.timeout)
            elif header.kind == PUSH and not header.shared:  # (a shared push sends nothing more)
                yield from drain(lane, self.schema.total, self._piece, self._tags.payload)

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(link: Link, timeout: float, failure: BaseException) -> None:
    """Answer the sender's handshake with the reason this receiver could not start."""
    lane = _answer_lane(link)
    if lane is not None:
        with contextlib.suppress(Error):  # the reason is this side's error, which the caller raises
            _handshake(lane, timeout, None, lambda schema, piece: [], failure=failure)


def _handshake(lane: Lane, timeout: float, expect: Any, allocate: Any, failure: BaseException | None = None,
               allow: bool = False, device: torch.device | None = None,
               zero_copy: bool = False) -> tuple[Schema, int, Offer, list[_Slot], list]:
    """Read the sender's offer, check it and allocate; answer the sender either way.

    With ``failure`` (this receiver could not start), answer with it and raise it. With ``allow``
    the shared segments the sender offers (same host) are mapped if this process can; the answer
    says whether they were, and (``zero_copy``, host segments) that versions are read where they lie.
    """
    what = "weight-sync handshake"
    started = time.monotonic()

    def left() -> float:
        return max(timeout - (time.monotonic() - started), 1e-3)

    def answer(status: int, text: str = "") -> None:
        run(send_bytes(lane, status_message(status, text), TAG_STATUS), lane, left(), what, "took no answer")

    offer = read_preamble(run(read_bytes(lane, PREAMBLE_SIZE, TAG_PREAMBLE, "handshake preamble", SchemaError),
                              lane, timeout, what))
    length, piece = offer.length, offer.piece
    try:
        check_offer(length, piece)
    except SchemaError as error:  # the schema itself cannot be received: refuse at once
        answer(REFUSED if failure is None else FAILED, str(error if failure is None else failure))
        raise
    raw = run(read_bytes(lane, length, TAG_SCHEMA, "weight schema", SchemaError), lane, left(), what)
    shared = b""
    if 0 < offer.shared <= max(offer_size(MAX_SEGMENTS), cuda_ipc.offer_size(MAX_SEGMENTS)):
        shared = run(read_bytes(lane, offer.shared, TAG_SCHEMA, "same-host offer", SchemaError), lane, left(), what)
    elif offer.shared:
        answer(REFUSED if failure is None else FAILED, f"a same-host offer of {offer.shared} bytes is out of range")
        raise SchemaError(f"the handshake announces a same-host offer of {offer.shared} bytes: out of range")
    if failure is not None:
        answer(FAILED, f"{type(failure).__name__}: {failure}")
        raise ReceiverFailed(str(failure))
    try:
        schema = Schema.from_json(raw)
        check_pieces(schema.total, piece, "weights")
        difference = None if expect is None else schema.first_difference(*_expected(expect))
        if difference:
            raise SchemaError(f"the sender's weights do not match `expect`: {difference}")
    except Exception as error:  # noqa: BLE001 - every reason to refuse goes back to the sender
        problem = str(error) if isinstance(error, SchemaError) else f"{type(error).__name__}: {error}"
        answer(REFUSED, problem)
        raise SchemaError(problem) from error
    try:  # allocate before answering, so that the sender learns if it fails
        slots = allocate(schema, piece)
    except Exception as error:  # noqa: BLE001 - the sender learns every reason
        problem = f"the receiver cannot allocate 2 x {schema.total} bytes: {type(error).__name__}: {error}"
        answer(FAILED, problem)
        raise ReceiverFailed(problem) from error
    mappings, route = [], "wire"
    if shared and allow:
        try:
            if cuda_ipc.is_device_offer(shared):
                mappings = cuda_ipc.map_offer(shared, schema.total, device)
            else:
                mappings = map_offer(shared, schema.total)
            route = "shared zero-copy" if zero_copy and not cuda_ipc.is_device_offer(shared) else "shared"
            if any(m.capacity != schema.total for m in mappings):
                mappings, route = [], "wire: the offered segments do not hold the weights' bytes"
        except Exception as error:  # noqa: BLE001 - whatever stops the mapping (a CUDA error too): the wire
            route = f"wire: {error}" if isinstance(error, MappingError) else f"wire: {type(error).__name__}: {error}"
    answer(ACCEPTED, f"{host_id()}\n{route}")
    return schema, piece, offer, slots, mappings
