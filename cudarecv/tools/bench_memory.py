"""The memory of a process tree, for the benches: ``bench/conftest.py`` prints each case's peak.

A sample is the sum of the processes' ``Pss`` (``/proc/PID/smaps_rollup``): a page mapped
by n processes counts 1/n in each, so memory shared between ranks (shared-memory segments,
libraries) counts once, where summing ``RSS`` counts it once per process. Linux only.
"""

from __future__ import annotations

import os
import threading


class TreeMemory:
    """The peak memory of this process and its descendants, sampled every ``interval`` s on a thread.

    A sample is the sum of the processes' ``Pss`` (``/proc/PID/smaps_rollup``: a page mapped by n
    processes counts 1/n in each, so shared memory counts once); :attr:`peaks` holds each case's peak
    (the case named by :meth:`enter`), in bytes. A failed sample ends the thread; :meth:`stop` raises it.
    """

    def __init__(self, interval: float = 0.5, root: int | None = None) -> None:
        self.interval = interval
        self.root = os.getpid() if root is None else root
        self.case = "(collection)"
        self.peaks: dict[str, int] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-tree-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the sampling thread (a sample takes milliseconds); raise what made a sample fail."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._error is not None:
            raise RuntimeError("sampling the process tree's memory failed") from self._error

    def enter(self, case: str) -> None:
        self.case = case

    def _loop(self) -> None:
        try:
            while True:
                case, size = self.case, tree_pss(self.root)
                self.peaks[case] = max(self.peaks.get(case, 0), size)
                if self._stop.wait(self.interval):
                    return
        except BaseException as error:  # kept for stop() to raise
            self._error = error


def tree_pss(root: int) -> int:
    """Bytes: the summed ``Pss`` of ``root`` and its descendants (processes that exit meanwhile count 0)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return total
