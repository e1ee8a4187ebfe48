"""The actor's end of a weight sync: :class:`WeightReceiver`, a receiver from one sender rank of a process group
(its siblings, each built of plain ones: ``ElasticReceiver`` in :mod:`~cudarecv.weights.membership.elastic_receiver`,
joining a named sender through a store; ``ShardedReceiver`` in :mod:`~cudarecv.weights.sharded.sharded_receiver`,
receiving from every rank of a sharded sender).

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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from tensordict import TensorDict

from ..core import shutdown, streams
from ..core.checks import check_timeout
from ..core.driver import Driver
from ..core.errors import ArgumentError, BrokenError, LinkError, UsageError, WaitTimeout
from ..core.link import Link, peer_failure, resolve
from ..core.log import logger
from ..core.protocol import Protocol
from ..core.transfer import Transfer
from ..samehost.policy import allowed
from ..wire.staging import Lane, drain, lane_for, release_pair
from . import handshake
from .handshake import expected
from .inbox import Inbox
from .options import TransportPolicy, check_receiver
from .pulling import Puller
from .relay import PATCH_BUFFER, Hop
from .schema import Schema
from .sharded.layout import is_sharded
from .slots import Slot, Slots, load_into
from .wire import PUSH, SessionTags

if TYPE_CHECKING:
    from typing_extensions import Self


class WeightReceiver:
    """Receive the versions a :class:`WeightSender` pushes; ``td`` is the latest complete one.

    Keyword Args:
        src / group_src: the sender's rank (global, or in ``group``); exactly one. The other receivers:
            :class:`~cudarecv.ElasticReceiver` joins a sender by name through a store (no process group shared by
            all; docs/weight-sync.md), :class:`~cudarecv.ShardedReceiver` receives from every rank of a sharded
            sender's mesh, into DTensors or slices (docs/sharded.md).
        group: the process group (a standalone one with ``group_src``).
        device: where the weights live (``"cpu"`` default, or a CUDA device).
        pin_memory: page-locked host storage (CPU only).
        expect: a tensordict or an ``nn.Module`` the weights must match (keys,
            shapes, dtypes; plain tensors); a mismatch raises :class:`SchemaError` naming the
            first differing key, and the sender's construction fails too.
        timeout: seconds any wait may take.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).
        transport: ``"auto"`` (map a same-host sender's snapshots if offered) or ``"wire"``;
            :attr:`transport` says which was taken.
        zero_copy: through shared memory (host weights, a sender on this machine), publish each version where
            the sender's snapshot lies instead of copying it out: a pull copies nothing, and :attr:`td`'s tensors
            are views of memory mapped *read-only* (writing to them kills the process with SIGSEGV: copy what you
            must change, or use :meth:`load_into`). :attr:`zero_copy` says whether it is in use.

    Whatever makes the construction fail once the link is resolved (a bad argument, no CUDA, no memory, ``expect``
    not matching, a malformed schema) is sent back as the handshake's answer, so the sender fails at once too,
    with this receiver's reason. The sender's mode (:attr:`mode`) comes with the handshake.

    Example:
        >>> receiver = WeightReceiver(src=0, device="cuda:0", expect=policy)
        >>> receiver.pull()              # blocks until a new version has landed
        >>> receiver.load_into(policy)   # or read receiver.td
    """

    def __init__(
        self,
        src: int | None = None,
        *,
        group: Any = None,
        group_src: int | None = None,
        device: Any = None,
        pin_memory: bool = False,
        expect: Any = None,
        timeout: float = 60.0,
        stream: Any = None,
        transport: TransportPolicy = "auto",
        zero_copy: bool = False,
    ) -> None:
        self.timeout = 60.0  # until checked: the time given to answer the sender
        try:
            self.timeout, device = check_receiver(timeout, transport, zero_copy, device, pin_memory)
            _check_plain(src, group_src, expect)
            problem = None
        except Exception as error:  # noqa: BLE001 - raised below, after the sender is told
            problem = error
        try:
            link = resolve(
                src, group_src, group, "src", "group_src"
            )  # before this, nobody to answer
        except Exception:
            if problem is not None:
                raise problem from None
            raise
        try:
            if problem is not None:
                raise problem
            lane = lane_for(link, device, stream, streams.StagingPool(), peers_at_once=True)
        except Exception as error:
            handshake.refuse(link, self.timeout, error)
            raise
        try:
            self.schema, bucket_bytes, offer, own, carrier, mappings, mailbox = handshake.answer(
                lane,
                self.timeout,
                expect,
                lambda schema, bucket_bytes: self._own_slots(
                    schema, bucket_bytes, device, pin_memory
                ),
                allow=allowed(transport),
                device=device,
                zero_copy=zero_copy and device.type == "cpu",
            )
        # as the sender lets go of its end: the pair's formations stay in step
        except BaseException:
            release_pair(lane.wire)
            raise
        #: what carries the versions: ``"shared memory"`` (the sender's snapshots, mapped read-only: this
        #: receiver is on the sender's machine), ``"cuda ipc"`` (its GPU snapshots, opened once) or ``"wire"``
        self.transport: str = carrier.name
        #: whether versions are published where they lie in the sender's shared snapshots (no copy; see ``zero_copy``)
        self.zero_copy = zero_copy and carrier.zero_copy and device.type == "cpu"
        aliases = (
            [
                Slot(self.schema, bucket_bytes, device, False, m.data[: self.schema.total])
                for m in mappings
            ]
            if self.zero_copy
            else []
        )
        #: the sender's mode, learnt in the handshake: ``"sync"`` or ``"latest"``
        self.mode = offer.mode
        tags = SessionTags.of(offer.session)
        self._cond = threading.Condition()
        self._closed = False
        self._pending: Transfer | None = None  # the pull under way (one at a time)
        self._pulling = False  # a thread's pull is under way: another's waits for its turn
        self._driver = Driver(
            f"cudarecv-pull-{link.peer}"
        )  # drives every receive (the caller keeps the time)
        self._inbox = Inbox(lane, tags, self._driver, mailbox)
        self._slots = Slots(own, aliases, self._cond, self._inbox.freed)
        self._hop = Hop(lane, tags, device, self._relay_links())
        self._puller = Puller(
            self.schema,
            bucket_bytes,
            self.mode,
            device,
            self._slots,
            carrier,
            mappings,
            self.zero_copy,
            self._hop,
            self._inbox,
            self._driver,
        )

    @property
    def _lane(self) -> Lane:
        """The lane to the sender (its inbox's, until close lets go of it)."""
        return self._inbox.lane

    def _relay_links(self) -> Callable[[int, int, float], Link] | None:
        """How this receiver's links to the others in a relay chain form (see :class:`~.relay.Hop`): None, they
        share its process group; a receiver that joined through a store forms each on the store."""
        return None

    def _own_slots(
        self, schema: Schema, bucket_bytes: int, device: torch.device, pin_memory: bool
    ) -> list[Slot]:
        """The two storages of this receiver's own that pulls land in."""
        return [Slot(schema, bucket_bytes, device, pin_memory) for _ in range(2)]

    # -- reading -----------------------------------------------------------------------------------------
    version = property(
        lambda self: self._puller.version, doc="The version published (0: none yet)."
    )

    arriving = property(
        lambda self: (
            self._pending is not None
            and not self._pending.settled
            and self._pending.timeout != math.inf
        ),
        doc="Whether a pull is under way and its version has begun to arrive (its own clock runs).",
    )

    @property
    def buffer_count(self) -> int:
        """How many distinct tensordicts :attr:`td` and :meth:`reading` hand out in turn: this receiver's two
        buffers, plus the sender's snapshots with :attr:`zero_copy` (a cache of views needs no more entries)."""
        return self._slots.count

    @property
    def td(self) -> TensorDict:
        """The latest complete, verified version (a locked tensordict of views): readable from the first
        successful pull on, also after :meth:`close`, after the sender closed and after a failed pull;
        :meth:`reading` holds it against the next pull."""
        return self._slots.td()

    def reading(self) -> contextlib.AbstractContextManager[TensorDict]:
        """Hold the latest version while reading it: no pull writes into it meanwhile.

        Example:
            >>> with receiver.reading() as td:
            ...     action = policy_from(td)(obs)
        """
        return self._slots.reading()

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> int:
        """Copy the latest version into ``module``'s parameters and buffers, in place; every name is matched and
        checked before anything is written; returns the version copied. With ``strict=False``, names missing on
        either side are skipped."""
        with self.reading() as td:
            load_into(td, module, strict)
            return self.version

    # -- pulling -----------------------------------------------------------------------------------------
    @overload
    def pull(self, wait: Literal[True] = ..., timeout: float | None = ...) -> int: ...
    @overload
    def pull(self, wait: bool, timeout: float | None = ...) -> int | Transfer: ...
    def pull(self, wait: bool = True, timeout: float | None = None) -> int | Transfer:
        """Receive a version newer than the one held; return its number once it has landed and been verified.

        In ``sync`` mode that is the next version pushed; in ``latest`` mode the newest one complete when the
        pull asks (the ones missed are skipped), and the pull waits only while the receiver already holds the
        newest. ``timeout``: seconds this pull may take (default: the receiver's). While no version has started
        to arrive, running out raises :class:`WaitTimeout` and the pull goes on: the next ``pull()`` carries on
        with it. Once a version arrives, it must land within ``timeout`` (relayed: the sender's timeout times its
        place in the chain). ``wait=False``: a :class:`~cudarecv.Transfer` whose ``wait()`` returns the version.
        Pulls from several threads take turns, each waiting up to ``timeout`` for another's (``WaitTimeout``).

        Raises:
            SenderClosed: the sender closed (at once, also between pulls); the last version stays readable.
            PushHeaderError / ChecksumError: the push was rejected and drained; the last version stays
                published and the next pull works.
            RelayLost: a relayed version did not come, for a receiver before this one in the chain failed; the
                last version stays published and the next pull gets the next version.
            OutOfStepError: a message that is no push of this handshake; TransferTimeout / PeerError: a version
                did not land within ``timeout``, or the sender died. After these the receiver is broken
                (:class:`BrokenError` from then on): close it and connect a new one.
        """
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        with self._turn(timeout):
            return self._pull_in_turn(wait, timeout)

    @contextlib.contextmanager
    def _turn(self, timeout: float) -> Iterator[None]:
        """Pulls from several threads take turns: wait up to ``timeout`` s for another thread's pull to end (its own
        timeout bounds it); ``close()`` ends the wait at once."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or not self._pulling, timeout=timeout):
                raise WaitTimeout(
                    f"another thread's pull held this WeightReceiver for {timeout:g} s (pulls from "
                    "several threads take turns)"
                )
            if self._closed:
                raise UsageError(
                    "this WeightReceiver closed while a pull waited for another thread's pull"
                )
            self._pulling = True
        try:
            yield
        finally:
            with self._cond:
                self._pulling = False
                self._cond.notify_all()

    def _pull_in_turn(self, wait: bool, timeout: float) -> int | Transfer:
        """:meth:`pull`, in this thread's turn."""
        if self._puller.broken:
            raise BrokenError(
                f"this WeightReceiver is broken ({self._puller.broken}): close it and connect a new one"
            )
        transfer = self._pending
        if (
            transfer is None or transfer.settled
        ):  # else: a pull under way (wait=False, or a wait that ran out)
            if wait and self.mode == "sync" and self._inbox.ringing:
                # the doorbell: wait for the header here, and if it rang take the version here too (a copy out
                # of the sender's segment, then a word back by the doorbell: nothing waits on the link), with no
                # thread between the sender and this one; else the link spoke: the pull's thread takes it
                if not self._inbox.wait_rung(timeout, lambda: self._closed):
                    raise self._nothing_came(timeout)
                if self._closed:  # (close() woke it)
                    raise UsageError("this WeightReceiver closed while the pull waited")
                if self._inbox.rung():
                    return self._puller.take_rung(timeout)
                if shutdown.exiting():  # (the exit hook closed the link, which woke this thread)
                    raise LinkError(
                        f"pull from rank {self._lane.link.peer}: the process is exiting; version "
                        f"{self.version} stays readable"
                    )
            transfer = self._pending = self._puller.start(timeout)
        if not wait:
            return transfer
        try:
            return transfer.wait(timeout)
        except WaitTimeout:
            if transfer.timeout != math.inf:  # a version is arriving: its own clock bounds the rest
                return transfer.wait()
            raise self._nothing_came(timeout) from None

    def _nothing_came(self, timeout: float) -> WaitTimeout:
        """A pull's wait ran out before any version began to arrive."""
        hint = (
            "the sender has pushed nothing newer yet"
            if self.mode == "latest"
            else "the sender pushed nothing: is it still pushing, to this rank?"
        )
        return WaitTimeout(
            f"pull from rank {self._lane.link.peer}: no version newer than {self.version} began "
            f"to arrive within {timeout:g} s ({hint}); the pull goes on: the next pull() carries "
            "on waiting"
        )

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop receiving and tell the sender, which stops sending to this rank. Idempotent.

        What the sender still has in flight to this rank is taken and dropped, until the sender's answer (all
        within ``timeout``); the published version stays readable. A pull still under way ends with
        :class:`UsageError`.
        """
        self._close(farewell=True)

    def _close(self, farewell: bool) -> None:
        """:meth:`close`; without ``farewell`` the sender is not told (it said it dropped this receiver: nobody
        answers) and nothing waits for its threads."""
        with self._cond:  # (one close runs: another thread's returns at once)
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # a pull waiting for another thread's ends now
        self._inbox.wake()  # and so does one asleep on the doorbell
        inbox = self._inbox
        # nobody to tell or wait for: the link broke, or the sender let go of this receiver already
        unheard = bool(self._puller.broken) or not farewell
        deadline = time.monotonic() + (0.0 if unheard else self.timeout)
        self._slots.keep_own_copy(busy=self._pending is not None and not self._pending.settled)
        bye = None
        if (
            inbox.standing is not None
            and not unheard
            and not inbox.sender_closed
            and inbox.claim_bye()
        ):
            try:
                bye = inbox.bye()
            except Exception as error:  # noqa: BLE001 - the sender's process is gone: nobody to tell, close goes on
                logger.info(
                    "a weight receiver closes without telling its sender, which is gone: %s",
                    peer_failure(error),
                )
        if bye is not None:
            with contextlib.suppress(Exception):
                Transfer(
                    self._farewell(),
                    self._lane.stream,
                    timeout=self.timeout,
                    driver=self._driver.submit,
                    link=self._lane.link,
                    raise_first=False,
                ).wait()
            if (
                inbox.released
            ):  # the sender answered BYE, so it took it and every word before: waited at once
                for work in inbox.asks.taken(
                    bye
                ):  # (parked, they kept the group's gloo context until exit)
                    work.wait()
        self._driver.stop(max(deadline - time.monotonic(), 0.0))
        self._hop.close(deadline)
        self._puller.patches.clear()
        # let go of the process group: a group kept alive past destroy_process_group() by objects in
        # reference cycles is destroyed at interpreter exit, where gloo aborts the process
        wire = None  # (a pair group of its own, on NCCL)
        with contextlib.suppress(UsageError):  # (a sender that dropped it: let go of already)
            wire = inbox.lane.wire
        inbox.forget(max(deadline - time.monotonic(), 0.0))
        release_pair(wire)  # (the last end on it shuts it down)
        self._pending = None

    def _farewell(self) -> Protocol:
        """Take what the sender still sends (a push in flight: drained) until its answer to BYE."""
        lane, inbox = self._lane, self._inbox  # bound now: close() lets go of them
        if self._pending is not None and not self._pending.settled:
            yield [self._pending.ended()]
        while not (inbox.released or inbox.sender_closed or self._puller.broken):
            header = yield from inbox.header()
            bucket_bytes, patches = self._puller.bucket_bytes, self._puller.patches
            if header.kind == PUSH and header.relayed and header.patch:  # (as below: a patch)
                pieces = patches.pieces(header.patch, bucket_bytes, self._hop)
                yield from self._hop.receive(header, pieces, PATCH_BUFFER, self.version)
            elif header.kind == PUSH and header.relayed:  # the hops after this one still need it
                index = self._slots.spare()
                slot = self._slots.own[index].writable()
                yield from self._hop.receive(header, slot.pieces, index, self.version)
            elif header.kind == PUSH and not header.shared:  # (a shared push sends nothing more)
                yield from drain(lane, patches.sizes(header, self.schema), inbox.tags.payload)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_plain(src: object, group_src: object, expect: Any) -> None:
    """A plain receiver has one sender rank and expects plain tensors: else an ArgumentError naming the
    receiver to build (a sharded sender's)."""
    if isinstance(src, (list, tuple)) or isinstance(group_src, (list, tuple)):
        raise ArgumentError(
            "a list of sender ranks is a sharded sender's mesh: build a cudarecv.ShardedReceiver "
            "(src=[...]) for it; a WeightReceiver takes one `src` or `group_src`"
        )
    try:
        sharded = expect is not None and is_sharded(expected(expect)[1])
    except Exception:  # noqa: BLE001 - a malformed `expect` is the handshake's to report, as ever
        sharded = False
    if sharded:
        raise ArgumentError(
            "`expect` holds DTensor leaves: build a cudarecv.ShardedReceiver (src=[the sender's "
            "ranks]), which receives the pieces of a sharded sender into that layout"
        )
