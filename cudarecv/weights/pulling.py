"""One pull of a weight receiver, as a protocol: ask for a newer version (latest mode), take the next header,
then the version by the route it names (a shared snapshot, a relay chain, or the wire; drained if rejected),
check it (BLAKE3 with ``verify``) and publish it; a pull that fails never touches the published version.

While no version has started to arrive the pull waits as long as its caller likes; only once one arrives
does its own clock run (:class:`~cudarecv.core.protocol.StartClock`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core import streams
from ..core.driver import Driver
from ..core.errors import (
    ChecksumError,
    Error,
    OutOfStepError,
    PeerError,
    PushHeaderError,
    RelayLost,
    SenderClosed,
    TransferTimeout,
    UsageError,
)
from ..core.link import Link
from ..core.protocol import Protocol, StartClock
from ..core.transfer import Transfer
from ..wire.control import wire_bytes
from ..wire.staging import Lane, drain, recv_into, send_from
from .delta import PatchError, Patches
from .inbox import Inbox
from .link import link_error
from .relay import PATCH_BUFFER, Hop, Relaying
from .schema import Schema
from .slots import Slot, Slots
from .transports.base import Transport
from .wire import ASK, CLOSED, GOT, LANDED, LOST, REJECTED, RELEASED, PushHeader, ask_message


class Puller:
    """What one receiver's pulls share: its schema, lane, slots, shared snapshots, relay part and inbox."""

    def __init__(
        self,
        schema: Schema,
        bucket_bytes: int,
        mode: str,
        device: torch.device,
        slots: Slots,
        transport: Transport,
        mappings: list[Any],
        zero_copy: bool,
        hop: Hop,
        inbox: Inbox,
        driver: Driver,
    ) -> None:
        self.schema, self.bucket_bytes, self.mode, self.device = schema, bucket_bytes, mode, device
        self.slots, self.mappings, self.zero_copy, self.hop, self.inbox = (
            slots,
            mappings,
            zero_copy,
            hop,
            inbox,
        )
        #: what the handshake took (the wire: none): it lands the versions of pushes that send the header alone
        self.transport, self.driver = transport, driver
        self.version = 0
        self.broken: str | None = None  # why this receiver takes no more pulls
        #: delta: where patches land and how they apply (its buffer allocated at the first patch)
        self.patches = Patches(
            schema, device, slots.own[0].storage.is_pinned() if slots.own else False
        )
        if device.type == "cuda":
            # a pushed version's digest (verify) is hashed on the receiver's GPU: its kernels are compiled now,
            # not in the first pull that checks one
            from ..cuda.digest import prepare

            prepare(device)

    @property
    def lane(self) -> Lane:
        """The lane to the sender (the inbox's)."""
        return self.inbox.lane

    def start(self, timeout: float, floor: int | None = None) -> Transfer:
        """Start a pull into the spare own slot (driven on the receiver's thread; no clock of its own yet).

        ``floor`` (latest mode; None: the version held): ask for a version newer than ``floor``. A sharded
        receiver (:mod:`cudarecv.weights.sharded.lineup`) asks just below the newest version another sender rank
        sent: past the version held, to wait for that one, or below it, to take the held version again if the
        sender has none newer (never with ``zero_copy``: that version is held where it lies in the sender's
        snapshot)."""
        slot, index = self._spare(timeout, floor)
        link = self.lane.link
        return Transfer(
            self._pull(slot, index, timeout, floor),
            self.lane.stream,
            timeout=math.inf,
            driver=self.driver.submit,
            on_error=self._failing(timeout, link, index),
            link=link,
            raise_first=False,
            what=f"pull of a version newer than {self.version} from rank {link.peer}",
        )

    def take_rung(self, timeout: float) -> int:
        """Sync mode, the doorbell rang (:meth:`Inbox.rung`): the whole pull on the caller's thread, with no
        :class:`Transfer` (no thread, future or deadline to keep): past the header it waits on nothing but this
        process's copy out of the sender's segment (and, into a GPU, its event) and its word back by the doorbell.
        Returns the version published; raises what :meth:`start`'s transfer would."""
        slot, index = self._spare(timeout, None)
        started = time.monotonic()
        protocol = self._pull(slot, index, timeout)
        try:
            with torch.no_grad():
                works = next(protocol)
                while True:
                    for (
                        work
                    ) in works:  # (the doorbell's header came: none of them waits on the link)
                        work.wait()
                    works = protocol.send(None)
        except StopIteration as ended:
            return int(ended.value)
        except BaseException as error:
            failure = self._failing(timeout, self.lane.link, index)(
                error, time.monotonic() - started
            )
            if failure is error:
                raise
            raise failure from error

    def _spare(self, timeout: float, floor: int | None) -> tuple[Slot, int]:
        """Before a pull: the spare own slot to land in (and its index), once nothing reads it any more."""
        if floor is not None and floor < self.version and self.zero_copy:
            raise UsageError(
                f"a zero-copy receiver holds version {self.version} in the sender's snapshot: it "
                f"cannot take it again (asked past {floor})"
            )
        if self.inbox.sender_closed:
            raise SenderClosed(
                f"{self.inbox.sender_closed}; version {self.version} stays readable in receiver.td"
            )
        index = self.slots.spare()
        forward = self.hop.forward_of(index)
        if forward is not None:  # relay: the forward of an earlier version may still read this slot
            with contextlib.suppress(Exception):
                forward.wait()  # bounded by its own timeout
            if (
                forward.failed
            ):  # a parked send may read it for as long as it likes: never write it again
                self.slots.renew(index, self.schema, self.bucket_bytes, self.device)
        slot = self.slots.wait_unread(index, timeout)
        if self.lane.stream is not None:
            streams.follow_caller(self.lane.stream)
        return slot, index

    def _failing(
        self, timeout: float, link: Link, index: int
    ) -> Callable[[BaseException, float], BaseException]:
        def failed(error: BaseException, elapsed: float) -> BaseException:
            relaying = self.hop.broken()  # (the hops after this one hear who failed)
            if relaying is not None:
                lost = self._lost(error, relaying, index)
                if lost is not None or (self.lane.nccl and relaying.up != self.hop.sender):
                    # a hop before this one failed, not its own link: the sender hears who (on NCCL, where it
                    # reads the word in turn, it then drops this receiver: the communicator broke)
                    with contextlib.suppress(Exception):
                        self.inbox.asks.post(
                            ask_message(GOT, relaying.version, LOST, relaying.lost)
                        )
                if lost is not None:
                    return lost
            if isinstance(error, Error) and error.link_usable and not isinstance(error, RelayLost):
                return (
                    error  # drained, the link in step (or the sender closed): the next pull is told
                )
            if isinstance(error, OutOfStepError):
                self.broken = str(error)
                return error
            seconds = timeout if isinstance(error, TimeoutError) else elapsed
            if isinstance(
                error, RelayLost
            ):  # (NCCL: the communicator broke with the hop that failed)
                replaced: BaseException = PeerError(
                    f"{error}; on NCCL the communicator broke with it: this receiver is broken"
                )
            elif isinstance(error, Error) and not isinstance(error, TimeoutError):
                replaced = error
            else:
                replaced = link_error(link, "pull", error, seconds, "sent no complete version")
            self.broken = str(replaced)
            return replaced

        return failed

    def _lost(self, error: BaseException, relaying: Relaying, index: int) -> RelayLost | None:
        """A relayed version did not come (``error``): :class:`RelayLost` if a hop before this one failed, this
        receiver staying in step with the sender (each push's hops have tags of their own, so nothing left posted
        takes a later one); None if this receiver is at fault (its own link to the sender, a lie, a deadline that
        fired far past its time: it was stopped itself) or on NCCL (a failed peer breaks the communicator). The own
        slot the version was landing in is never written again if receives from that hop may still be posted; a
        hop whose link broke is let go of (it died, or left)."""
        if relaying.up == self.hop.sender or self.lane.nccl or isinstance(error, OutOfStepError):
            return None
        if isinstance(
            error, RelayLost
        ):  # (the hop before said so in its trailer: everything arrived)
            return error
        if not isinstance(error, Error) or (isinstance(error, TimeoutError) and relaying.overdue()):
            return None
        if relaying.index == PATCH_BUFFER:
            self.patches.renew()
        else:
            self.slots.renew(index, self.schema, self.bucket_bytes, self.device)
        if isinstance(error, PeerError):
            self.hop.forget(relaying.up)
        lost = RelayLost(
            f"pull of version {relaying.version}: the link to rank {relaying.up}, the hop before this "
            f"receiver in the relay chain, failed during the push ({error}); version {self.version} "
            "stays published, and the next version comes through the chain healed"
        )
        lost.__cause__ = error
        return lost

    def _pull(self, slot: Slot, index: int, timeout: float, floor: int | None = None) -> Protocol:
        lane, inbox = self.lane, self.inbox
        asked = self.version if floor is None else floor
        # the words the sender has taken once this pull's push comes: in latest mode those before our ASK on the link
        # (its listener reads them in order; asked by the doorbell, none: the doorbell's count says), in sync mode
        # those up to our last GOT (its push waited for it)
        mark = inbox.asks.mark() if self.mode == "latest" else inbox.answered
        # latest mode: ask for a version newer than ours (or than the floor), by the doorbell if it rings (the push
        # that publishes one answers, on its own thread), else (or if one is out already) on the link
        if self.mode == "latest" and inbox.ask_by_bell(asked):
            mark = 0
        elif self.mode == "latest":
            sent = yield from send_from(
                lane, [wire_bytes(lane, ask_message(ASK, asked))], [inbox.tags.ask], defer=True
            )
            if sent:
                yield sent
        header = yield from inbox.header()
        if header.kind == CLOSED:
            raise SenderClosed(
                f"{inbox.sender_closed}; version {self.version} stays readable in receiver.td"
            )
        if header.kind == RELEASED:
            raise UsageError("this WeightReceiver closed while the pull waited")
        taken = inbox.asks.taken(inbox.taken_mark(mark))
        if taken:
            yield taken  # (returns at once) and lets them go
        # a version is arriving: it must land within the pull's timeout (a relay's hop: the time its header gives)
        yield [StartClock(header.wait_ms / 1e3 if header.relayed else timeout)]
        total, bucket_bytes = self.schema.total, self.bucket_bytes
        # never sized from the header (a patch: at most the version's bytes)
        if (header.total, header.bucket_bytes) != (total, bucket_bytes):
            raise OutOfStepError(
                f"a push of {header.total} bytes in {header.bucket_bytes}-byte messages does not match the handshake "
                f"({total} bytes in {bucket_bytes}-byte messages): not drained, the link is out of step"
            )
        if header.patch and (header.patch >= total or header.shared):
            raise OutOfStepError(
                f"a patch of {header.patch} bytes for a version of {total} (shared: {header.shared}) is "
                "none this receiver takes: not drained, the link is out of step"
            )
        problem = None
        if header.fingerprint != self.schema.fingerprint:
            problem = (
                f"a push with fingerprint {header.fingerprint.hex()} does not match the handshake "
                f"({self.schema.fingerprint.hex()})"
            )
        elif (
            header.version <= asked or header.version < self.version
        ):  # (asked below it: the held one is taken)
            problem = (
                f"version {header.version} is not newer than the current {self.version}"
                if floor is None
                else f"version {header.version} is not newer than {asked}, asked for, or older than the current "
                f"{self.version}"
            )
        elif header.patch and header.base != self.version:
            problem = (
                f"a patch against version {header.base} came, but this receiver holds version {self.version} "
                "(the sender sends the next version whole)"
            )
        self.patches.writing(slot)  # (whatever lands in it, it holds no version until published)
        if header.shared:
            slot = yield from self._take_shared(header, slot, problem)
        elif header.relayed and header.patch:  # forwarded, applied or not
            pieces = self.patches.pieces(header.patch, bucket_bytes, self.hop)
            yield from self.hop.receive(header, pieces, PATCH_BUFFER, self.version)
        elif header.relayed:  # forwarded, published or not
            yield from self.hop.receive(header, slot.pieces, index, self.version)
        elif problem:
            yield from drain(lane, self.patches.sizes(header, self.schema), inbox.tags.payload)
        elif header.patch:
            pieces = self.patches.pieces(header.patch, bucket_bytes, self.hop)
            yield from recv_into(lane, pieces, [inbox.tags.payload] * len(pieces))
        else:
            yield from recv_into(lane, slot.pieces, [inbox.tags.payload] * len(slot.pieces))
        if problem:
            inbox.tell(header, REJECTED)
            raise PushHeaderError(
                f"{problem}: rejected and drained; version {self.version} stays published"
            )
        if lane.stream is not None:
            yield [
                streams.EventWork(streams.record(lane.stream))
            ]  # verify and publish landed bytes only
        if (
            header.patch
        ):  # the held version, then what changed, into the spare slot (not the published)
            try:
                self.patches.apply(header, slot, self.slots.published, lane.stream)
            except PatchError as error:
                inbox.tell(header, REJECTED)
                raise PatchError(
                    f"version {header.version} did not apply as a patch of version {header.base}: {error}; "
                    f"rejected, version {self.version} stays published"
                ) from error
        if header.verify:
            with (
                torch.cuda.stream(lane.stream)
                if lane.stream is not None
                else contextlib.nullcontext()
            ):
                # every message's digest queued, their results copied back at once
                pending = slot.digest_pending()
            yield [pending.work]  # (one event for the whole version, within the pull's deadline)
            got = pending.value()
            if got != header.checksum:
                self.patches.rejected()
                inbox.tell(header, REJECTED)
                raise ChecksumError(
                    f"version {header.version} arrived corrupted (BLAKE3 {got.hex()} != "
                    f"{header.checksum.hex()}): rejected; version {self.version} stays published"
                )
        freed = self.slots.publish(slot, header.version, tell=False)
        self.patches.published(slot, header.version)
        self.version = header.version
        inbox.tell(header, LANDED, freed)
        return header.version

    def _take_shared(self, header: PushHeader, slot: Slot, problem: str | None) -> Protocol:
        """A sub-protocol: take a shared push's version from the sender's snapshot (the segment the header names,
        checked against the handshake; not when ``problem``: a rejected push) and return the slot to publish:
        ``slot`` with the version copied into it, or (zero-copy) the snapshot itself. Raises if a write of a newer
        version overtook the copy, or overwrote the snapshot (the stamps of :mod:`cudarecv.samehost.shared_memory`)."""
        lane, total = self.lane, self.schema.total
        if not 0 <= header.segment < len(self.mappings):
            raise OutOfStepError(
                f"a push names shared segment {header.segment}, but the handshake mapped "
                f"{len(self.mappings)}: the link is out of step"
            )
        if problem is not None:
            return slot
        mapping = self.mappings[
            header.segment
        ]  # (its capacity is the schema's total: checked at the handshake)
        if self.zero_copy:
            alias = self.slots.aliases[header.segment]
            with self.slots.cond:
                if alias.version is not None or alias.readers:
                    raise OutOfStepError(
                        f"a push of version {header.version} names shared segment "
                        f"{header.segment}, which this zero-copy receiver still holds (version "
                        f"{alias.version}): the link is out of step"
                    )
            if not self.transport.lies_whole(mapping, header.version):
                raise TransferTimeout(
                    f"the sender's shared snapshot does not hold version {header.version} "
                    f"whole (the sender stopped waiting for this receiver: it was too slow); "
                    f"version {self.version} stays published"
                )
            return alias
        return (
            yield from self.transport.land(mapping, slot, total, header.version, lane, self.version)
        )
