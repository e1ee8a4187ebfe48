"""What a failed drop-in call says: what it waited for, the likely cause, and (its error hook) the peer, the
stage its own timeout struck in, and which tags and tensordicts the link refuses from then on (:mod:`cudarecv.core.stuck`)."""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import TensorDictBase

from ..core import stuck
from ..core.errors import Error, PeerError, TransferTimeout
from ..core.link import Link, peer_failure
from ..core.protocol import ErrorHook
from ..core.tags import header_tag
from ..plan.plan import Plan
from ..samehost.policy import Carried
from .options import CallOptions


def explaining(
    td: TensorDictBase,
    link: Link,
    timeout: float | None,
    waited_for: str,
    cause: str,
    tags: Sequence[int],
    sending: bool,
    route: Carried | None = None,
) -> ErrorHook:
    """The error hook of one call: name the peer, what was waited for (``waited_for``, or the stage its
    own timeout struck in) and the likely cause; a link left with messages in flight is refused for ``td``
    from then on, and after a timeout for the call's ``tags`` in its direction too (:mod:`.stuck`), but for
    a send that had nothing in flight (it waited for its turn on the link's thread); a same-host receive that
    waited for its turn (its ``route`` says so) is named so."""

    def explain(error: BaseException, elapsed: float) -> BaseException:
        if isinstance(error, Error) and not isinstance(error, TransferTimeout):
            if not error.link_usable:
                stuck.mark(td, link, type(error).__name__)
            return error  # ours: a mismatch (drained), a lie (out of step)
        group = link.group_timeout()
        what, why, late = (
            waited_for,
            cause,
            tags,
        )  # (late: where the peer's part may still come, or ours go)
        stage = getattr(
            error, "stage", None
        )  # where a wait failed (Transfer notes it), past the call's first
        if isinstance(error, TransferTimeout):  # the call's own timeout=
            seconds, gloo = timeout, ""
            if sending and not error.in_flight:
                late = ()
            if (
                route is not None and route.waiting and route.behind == "tags"
            ):  # never posted: its turn not come
                what = f"{waited_for}, waiting for an earlier receive from rank {link.peer} on its tags to end"
                why = (
                    "receives with one init_tag take the sender's messages one after the other, in the order "
                    "they were posted: did the sender send fewer transfers than were posted?"
                )
            elif (
                route is not None and route.waiting
            ):  # a same-host receive never posted (the sender's part may come)
                what = f"{waited_for}, queued behind an earlier receive from rank {link.peer} on this link's thread"
                why = (
                    "a same-host link takes receives one at a time, in call order, and the sender's sends "
                    "likewise: were the receives posted in the order of its sends?"
                )
            elif (
                error.stage is not None
            ):  # past what the call waits for first (the protocol said where)
                what, why = error.stage, "it began this transfer: did it stop or die midway?"
        elif (
            group is not None and elapsed >= group - 0.05
        ):  # the process group's timeout ran out in gloo
            seconds, gloo = group, "; gloo then closed every link of the process group"
            if stage is not None:
                what, why = stage, "it began this transfer: did it stop or die midway?"
        else:
            stuck.mark(td, link, "the link failed")
            return PeerError(
                f"{stage or waited_for}: the link to rank {link.peer} failed after {elapsed:.3g} s: "
                f"{peer_failure(error)}"
            )
        stuck.mark(td, link, f"it timed out after {seconds:g} s", late, sending)
        refused = (
            f"this tensordict, and tags {tag_span(late)} for any tensordict, are refused for "
            f"{'sends' if sending else 'receives'}"
            if late
            else "this tensordict is refused"
        )
        return TransferTimeout(
            f"{what}: rank {link.peer} did not answer within {seconds:g} s ({why}){gloo}; gloo cannot take "
            f"back what was posted, so {refused} on this link from now on"
        )

    return explain


def tag_span(tags: Sequence[int]) -> str:
    """``tags`` in words for a message: ``1073741824 and 1342177280``, ``0..4``, ``0 and 9 others``."""
    if len(tags) <= 2:
        return " and ".join(map(str, tags)) or "(none)"
    if isinstance(tags, range):
        return f"{tags[0]}..{tags[-1]}"
    return f"{tags[0]} and {len(tags) - 1} others"


def waited_for(sending: bool, plan: Plan, call: CallOptions) -> tuple[str, str]:
    """What a call waits for, and the likely cause if it never comes, for its timeout message."""
    verb = "send" if sending else "receive"
    peer = "the receiver post the matching receive" if sending else "the sender send"
    init_tag = call.init_tag
    if call.fast_wire:
        what = f"{verb} of the fast-wire header (tag {header_tag(init_tag)})"
        return (
            what,
            f"does {peer} on the fast wire too (bucket_bytes on both ends), with init_tag={init_tag}?",
        )
    if call.consolidated:
        return (
            f"{verb} of the consolidated storage (tag 0)",
            f"does {peer} with consolidated=True, no bucket_bytes?",
        )
    n = len(plan.tensors)
    tags = (
        f"pseudo-random tags from init_tag={init_tag}"
        if call.pseudo_rand
        else f"tags {init_tag}..{init_tag + n - 1}"
    )
    return (
        f"{verb} of {n} leaves ({tags})",
        f"does {peer} on the stock wire (no bucket_bytes) with init_tag={init_tag}, "
        f"pseudo_rand={call.pseudo_rand}?",
    )
