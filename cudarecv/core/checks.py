"""Argument checks shared by every layer: each names the argument and the fix, before anything is sent."""

from __future__ import annotations

from typing import Literal, overload

from .errors import ArgumentError

#: the longest timeout taken, in seconds (11.6 days); past about 9.2e9 s a thread's wait overflows
MAX_TIMEOUT = 1e6


@overload
def check_timeout(
    timeout: object, name: str = ..., or_none: Literal[False] = ..., or_zero: bool = ...
) -> float: ...
@overload
def check_timeout(
    timeout: object, name: str = ..., or_none: bool = ..., or_zero: bool = ...
) -> float | None: ...
def check_timeout(
    timeout: object, name: str = "timeout", or_none: bool = False, or_zero: bool = False
) -> float | None:
    """``timeout`` as float seconds: positive (or zero, with ``or_zero``: a poll), finite, at most
    :data:`MAX_TIMEOUT`, or None with ``or_none`` (no bound of the call's own); else an
    :class:`ArgumentError` naming ``name``.

    Example:
        >>> check_timeout(5)
        5.0
        >>> check_timeout(float("inf"))  # ArgumentError: `timeout` must be a positive number ...
    """
    if timeout is None and or_none:
        return None
    low_ok = (lambda t: t >= 0) if or_zero else (lambda t: t > 0)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (low_ok(timeout) and timeout <= MAX_TIMEOUT)
    ):
        what = "a non-negative" if or_zero else "a positive"
        fallback = " or None" if or_none else ""
        raise ArgumentError(
            f"`{name}` must be {what} number of seconds up to {MAX_TIMEOUT:g}{fallback}, "
            f"got {timeout!r}"
        )
    return float(timeout)


def check_bucket_bytes(bucket_bytes: object) -> None:
    """``bucket_bytes`` is None or a positive int, else a ValueError saying so."""
    if bucket_bytes is not None and (
        not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0
    ):
        raise ArgumentError(
            f"`bucket_bytes` must be a positive int (the bytes per message, e.g. 1 << 20), "
            f"got {bucket_bytes!r}; pass None for the stock wire"
        )
