"""What the tools print about where they run, and how they show progress.

Example:
    >>> versions()
    'cudarecv 0.1.0, torch 2.13.0+cpu, tensordict 0.15.3'
"""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from typing import Any


def available_memory() -> int | None:
    """Bytes of memory available to new processes (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine and the time, in pytest-benchmark's JSON keys."""
    return {
        "machine_info": {
            "node": platform.node(),
            "processor": platform.processor(),
            "system": platform.system(),
            "machine": platform.machine(),
            "python_version": platform.python_version(),
        },
        "datetime": datetime.now(timezone.utc).isoformat(),
    }


def versions() -> str:
    """The versions of cudarecv, torch and tensordict, for headers."""
    import tensordict
    import torch

    from cudarecv import __version__

    return f"cudarecv {__version__}, torch {torch.__version__}, tensordict {tensordict.__version__}"


def tail(error: str, lines: int = 8) -> str:
    """The end of a rank's traceback (where it raised), not all of it."""
    text = error.strip().splitlines()
    return "\n".join(text if len(text) <= lines else [text[0], "  ...", *text[-(lines - 2) :]])


def progress(text: str) -> None:
    """One progress line on stderr, flushed at once: one write, the newline with the text (``print`` writes
    them apart, and a Ctrl-C between the two would glue the next line, the error's, to this one)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
