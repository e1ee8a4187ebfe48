"""One drop-in call's options, checked together before anything is sent: what travels from
:func:`~cudarecv.p2p.calls.isend` (``irecv``, ``send``, ``recv``) to the transfer it starts and to the
message of its error."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import SupportsIndex, cast

import torch

from ..core.checks import check_bucket_bytes, check_timeout
from ..core.errors import ArgumentError, ArgumentTypeError
from ..core.tags import check_init_tag
from ..samehost.policy import TransportPolicy, check_transport


@dataclass(frozen=True)
class CallOptions:
    """A call's options as its transfer uses them (see :func:`~cudarecv.p2p.calls.isend` for each)."""

    init_tag: int  # 0 where stock ignores it (consolidated, stock wire)
    pseudo_rand: bool
    consolidated: bool
    bucket_bytes: (
        int | None
    )  # None: the stock wire; else the fast wire in messages of this many bytes
    stream: torch.cuda.Stream | None
    timeout: float | None  # None: the process group's
    transport: TransportPolicy

    @property
    def fast_wire(self) -> bool:
        return self.bucket_bytes is not None


def call_options(
    init_tag: object,
    pseudo_rand: bool,
    consolidated: bool,
    bucket_bytes: object,
    stream: torch.cuda.Stream | None,
    timeout: object,
    transport: object,
) -> CallOptions:
    """Check a call's options, in this order (before its peer: an ArgumentError names the first wrong one)."""
    return CallOptions(
        init_tag=_init_tag(init_tag, pseudo_rand, consolidated, bucket_bytes),
        pseudo_rand=pseudo_rand,
        consolidated=consolidated,
        bucket_bytes=cast("int | None", bucket_bytes),  # (checked with init_tag)
        stream=stream,
        timeout=check_timeout(timeout, or_none=True),
        transport=_transport(transport),
    )


def _transport(transport: object) -> TransportPolicy:
    return check_transport(transport)


def _init_tag(
    init_tag: object, pseudo_rand: object, consolidated: object, bucket_bytes: object
) -> int:
    """Check ``bucket_bytes`` and ``init_tag``; return ``init_tag`` as an int."""
    check_bucket_bytes(bucket_bytes)
    if consolidated and bucket_bytes is None:
        return 0  # one message with tag 0: stock ignores init_tag and pseudo_rand here
    if isinstance(init_tag, bool):
        raise ArgumentTypeError("`init_tag` must be an int, got bool")
    try:
        # numpy integers too, as stock takes them
        tag = operator.index(cast(SupportsIndex, init_tag))
    except TypeError:
        raise ArgumentTypeError(
            f"`init_tag` must be an int, got {type(init_tag).__name__}"
        ) from None
    if tag < 0:
        fix = (
            "`pseudo_rand=True` seeds numpy with it, which takes non-negative seeds only"
            if pseudo_rand
            else "gloo takes tags 0..2**31 - 1"
        )
        raise ArgumentError(f"`init_tag={tag}` is negative, but {fix}: pass init_tag >= 0")
    if bucket_bytes is not None:
        check_init_tag(tag)
    return tag
