"""The checks of a weight sender's and receiver's keyword arguments, in one place (the constructors and
integrations that configure them ahead, e.g. :mod:`cudarecv.torchrl`, use the same)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..core import streams
from ..core.checks import check_bucket_bytes, check_timeout
from ..core.errors import ArgumentError
from ..samehost.policy import (
    TransportPolicy as TransportPolicy,
)  # (re-exported: cudarecv.TransportPolicy)
from ..samehost.policy import check_transport
from .schema import WIRE_DTYPES
from .wire import FANOUTS, MODES

#: a sender's mode: every receiver gets every version (``"sync"``), or each pull the newest (``"latest"``)
Mode = Literal["sync", "latest"]
#: a sender's fan-out: to every receiver (``"star"``), through a chain of them (``"relay"``), or picked at the
#: handshake (``"auto"``: relay when a receiver is on another host, in sync mode)
Fanout = Literal["star", "relay", "auto"]
# ``TransportPolicy`` (what may carry the versions: ``"auto"`` or ``"wire"``) is samehost.policy's, which checks it


def check_mode(mode: object, buffers: object = None, fanout: object = "auto") -> None:
    """``mode``, ``buffers`` (latest mode's snapshots) and ``fanout`` go together, else an ArgumentError."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ArgumentError(f"`mode` must be one of {MODES}, got {mode!r}")
    if buffers is not None and (
        mode != "latest" or isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2
    ):
        raise ArgumentError(
            f"`buffers` is for mode='latest', an int >= 2; got {buffers!r} with mode={mode!r}"
        )
    if not isinstance(fanout, str) or fanout not in FANOUTS:
        raise ArgumentError(f"`fanout` must be one of {FANOUTS}, got {fanout!r}")
    if fanout == "relay" and mode != "sync":
        raise ArgumentError(
            "fanout='relay' is for mode='sync': in 'latest' mode each receiver pulls at its own "
            "pace, and a chain would make each wait for the one before it; use fanout='star'"
        )


def check_flag(value: object, name: str) -> bool:
    """``value`` is True or False, else an ArgumentError naming ``name``."""
    if not isinstance(value, bool):
        raise ArgumentError(f"`{name}` must be True or False, got {value!r}")
    return value


def check_options(**options: Any) -> dict[str, Any]:
    """Check weight-sync keyword arguments without building a sender or receiver; return them normalized.

    Names: any ending in ``timeout`` (seconds), ``bucket_bytes``, ``transport``, ``mode`` (with ``buffers``
    and ``fanout``), and the flags ``verify``, ``zero_copy`` and ``delta``. Raises :class:`ArgumentError` naming the
    argument and the fix, or one that is none of these.

    Example:
        >>> check_options(timeout=30, bucket_bytes=1 << 20, transport="auto")
        {'timeout': 30.0, 'bucket_bytes': 1048576, 'transport': 'auto'}
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name.endswith("timeout"):
            out[name] = check_timeout(value, name)
        elif name == "bucket_bytes":
            check_bucket_bytes(value)
            out[name] = value
        elif name == "transport":
            out[name] = check_transport(value)
        elif name in ("verify", "zero_copy", "delta"):
            out[name] = check_flag(value, name)
        elif name not in ("mode", "buffers", "fanout"):
            raise ArgumentError(
                f"`{name}` is no weight-sync option (timeouts, bucket_bytes, transport, mode, "
                "buffers, fanout, verify, zero_copy, delta)"
            )
    if {"mode", "buffers", "fanout"} & set(options):
        check_mode(
            options.get("mode", "sync"), options.get("buffers"), options.get("fanout", "auto")
        )
        out.update({k: options[k] for k in ("mode", "buffers", "fanout") if k in options})
    return out


def check_sender(
    timeout: object,
    bucket_bytes: object,
    transport: object,
    mode: object,
    buffers: object,
    fanout: object,
    delta: object = False,
    wire_dtype: object = None,
) -> float:
    """A weight sender's options checked together, before it resolves any link: its timeout, in seconds."""
    checked = check_options(
        timeout=timeout, transport=transport, bucket_bytes=bucket_bytes, delta=delta
    )
    check_mode(mode, buffers, fanout)
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise ArgumentError(
            f"`wire_dtype` must be None or a floating-point dtype ({', '.join(map(str, WIRE_DTYPES))}), "
            f"got {wire_dtype!r}"
        )
    return float(checked["timeout"])


def check_receiver(
    timeout: object, transport: object, zero_copy: object, device: Any, pin_memory: bool
) -> tuple[float, torch.device]:
    """A weight receiver's options checked together: its timeout, and its device with an index (threads use it)."""
    checked = check_options(timeout=timeout, transport=transport, zero_copy=zero_copy)
    if zero_copy and pin_memory:
        raise ArgumentError(
            "`zero_copy=True` publishes the sender's shared snapshots, which are not "
            "page-locked: drop `pin_memory=True` or `zero_copy`"
        )
    try:
        device = streams.explicit(torch.device(device if device is not None else "cpu"))
    except (RuntimeError, TypeError) as error:
        raise ArgumentError(
            f'`device` must name a device ("cpu", "cuda:0"), got {device!r}: {error}'
        ) from None
    if pin_memory and device.type != "cpu":
        raise ArgumentError(
            f"`pin_memory=True` is for host memory, but `device` is {device}: drop one"
        )
    return float(checked["timeout"]), device
