"""Settings kept by ``python -m cudarecv tune``: one JSON file per user, one entry per machine.

The file is ``$XDG_CACHE_HOME/cudarecv/tune.json`` (``~/.cache/cudarecv/tune.json`` without
``XDG_CACHE_HOME``); its entries are keyed by :func:`machine` (host name, CPU model, CPU count),
so a home directory shared by several machines keeps each one's choice. A process reads it once,
at the first use of a tuned setting, under a lock; a setting's environment variable overrides its
entry (:mod:`cudarecv.core.host_copy`). Nothing is measured outside ``tune``.

A file that is not there means nothing was tuned: the defaults. So does a location this process
cannot look into (a directory it may not search, e.g. a ``HOME`` it cannot read after dropping
privileges; a path through a regular file): no ``tune`` of its own could write there either, so it
runs with the defaults, said once as a warning on the ``cudarecv`` logger. A file that is there
and cannot be read as a tune file (not JSON, another format, a directory) is refused by name
with the fix (``tune`` again, or delete it), as a setting may have been meant.

Example:
    >>> tuned("host_copy")  # after `python -m cudarecv tune` on this machine
    'stream'
"""

from __future__ import annotations

import errno
import json
import os
import platform
import socket
import threading
from pathlib import Path
from typing import Any

from .errors import ArgumentError, UsageError
from .log import logger

FORMAT = 1  # the file's layout: {"format": 1, "machines": {machine(): {"settings": {...}, ...}}}
_lock = threading.Lock()
_entry: dict[str, Any] | None = None  # this machine's entry, once read


def path() -> Path:
    """Where ``tune`` keeps its choices."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "cudarecv" / "tune.json"


def machine() -> str:
    """This machine's key in the file: host name, CPU model and CPU count."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    return f"{socket.gethostname()} / {model} / {os.cpu_count()} CPUs"


def refused(what: str) -> ArgumentError:
    """The error for a bad tune file: ``what`` is wrong in it, and the fix."""
    return ArgumentError(
        f"{path()}: {what}; run `python -m cudarecv tune` again, or delete the file"
    )


#: what an unreadable location raises (the process may not search a directory of the path, or read the file; a
#: component of the path is not a directory): no tune file of this process's can be there, nothing was tuned
_UNREADABLE = (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)


def _read_all() -> dict[str, Any]:
    """Every machine's entry in the tune file ({} if there is none, or if this process cannot look where it
    would be: logged), checked."""
    where = path()
    try:
        raw = where.read_text()
    except FileNotFoundError:
        return {}
    except OSError as error:
        if error.errno in _UNREADABLE:
            logger.warning(
                "the tune file %s cannot be read by this process (%s): nothing tuned, the defaults are "
                "used; set XDG_CACHE_HOME to a directory it may read (where `python -m cudarecv tune` "
                "ran as this user), or the settings' environment variables",
                where,
                error.strerror or type(error).__name__,
            )
            return {}
        raise refused(f"cannot be read ({error.strerror})") from None
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise refused(f"not JSON ({error})") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not isinstance(data.get("machines"), dict)
    ):
        raise refused(f"not a cudarecv tune file of format {FORMAT}")
    for key, entry in data["machines"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("settings"), dict)):
            raise refused(f'the entry of {key!r} has no "settings" object')
    return data["machines"]


def entry() -> dict[str, Any]:
    """This machine's entry (``{}`` if ``tune`` never ran here): read once per process."""
    global _entry
    with _lock:
        if _entry is None:
            _entry = _read_all().get(machine(), {})
        return _entry


def tuned(name: str) -> tuple[Any, str] | None:
    """The value ``tune`` kept for setting ``name`` on this machine and where it was kept, or None."""
    kept = entry()
    if name not in kept.get("settings", {}):
        return None
    return kept["settings"][name], f"tuned {kept.get('at', '?')} in {path()}"


def save(settings: dict[str, Any], measured: dict[str, Any], at: str) -> Path:
    """Keep ``settings`` (and the times they were chosen by) as this machine's entry; other machines'
    entries stay (all are dropped if the file is bad). Written whole and renamed into place, so a reader
    never sees half a file."""
    global _entry
    where = path()
    with _lock:
        try:
            machines = _read_all()
        except ArgumentError as error:
            logger.warning("replacing a bad tune file: %s", error)
            machines = {}
        machines[machine()] = {"settings": settings, "measured": measured, "at": at}
        partial = where.with_name(f"{where.name}.{os.getpid()}.tmp")
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(
                json.dumps({"format": FORMAT, "machines": machines}, indent=2, sort_keys=True)
                + "\n"
            )
            os.replace(partial, where)
        except OSError as error:
            raise UsageError(
                f"the tune file {where} cannot be written ({error.strerror or error}): point "
                "XDG_CACHE_HOME at a folder this process may write, then run tune again"
            ) from error
        _entry = machines[machine()]
    return where
