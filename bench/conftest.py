"""pytest configuration of the benchmarks.

Run them with::

    pytest bench/ -p no:cacheprovider --benchmark-json BENCH.json
    python -m cudarecv report BENCH.json

The project's pytest configuration keeps the default ``python_files``
(``test_*.py``, for ``tests/``), so this conftest collects the ``bench_*.py``
files of this folder itself; no ``-o python_files=...`` is needed (and passing
it, or naming a bench file on the command line, does not collect a file twice).

Timing: the benches that measure inside ranks or child processes hand those
times to pytest-benchmark through a virtual clock
(:class:`cudarecv.tools.transfer_ranks.VirtualClock`, set per module with
``pytest.mark.benchmark(timer=CLOCK)``, fed by ``tb.replay``), so the table
pytest-benchmark prints and its JSON ``stats`` are the measured times of the
mode each bench names; ``bench_plan.py`` times its lookup in this process
with pytest-benchmark's own clock.

Memory: a thread samples this process and its descendants every 0.5 s (:class:`TreeMemory`: the
sum of their ``Pss``, so memory shared between processes counts once); the run ends with the
peak, the case it came in, and the cases of the highest peaks.

Fixtures: ``transfer_cluster``, a :class:`cudarecv.testing.launch.Ranks` of 2 ranks
for the whole session (started when a bench first asks for it), restarted if a
failure closed it; ``transfer_targets``, a list of lines printed at the end of
the run (the transfer benches' target ratios).
"""

from __future__ import annotations

import fnmatch
import os
import threading
from pathlib import Path
from typing import Iterator

import pytest

from cudarecv.testing.launch import Ranks

_TARGET_LINES: list[str] = []


class TreeMemory:
    """The peak memory of this process and its descendants, sampled every ``interval`` s on a thread.

    A sample is the sum of the processes' ``Pss`` (``/proc/PID/smaps_rollup``: a page mapped by n
    processes counts 1/n in each, so shared memory counts once); :attr:`peaks` holds each case's peak
    (the case named by :meth:`enter`).
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.case = "(collection)"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-tree-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def enter(self, case: str) -> None:
        self.case = case

    def _loop(self) -> None:
        while True:
            case, size = self.case, tree_pss(os.getpid())
            self.peaks[case] = max(self.peaks.get(case, 0), size)
            if self._stop.wait(self.interval):
                return


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


_MEMORY = TreeMemory()


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix != ".py" or not fnmatch.fnmatch(file_path.name, "bench_*.py"):
        return None
    if parent.session.isinitpath(file_path):
        return None  # named on the command line: pytest's python plugin collects it
    if any(fnmatch.fnmatch(file_path.name, p) for p in parent.config.getini("python_files")):
        return None  # run with -o python_files=bench_*.py: collected by pytest already
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_sessionstart(session: pytest.Session) -> None:
    _MEMORY.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _MEMORY.stop()


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _MEMORY.enter(nodeid)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test time limit (pytest-timeout)")
    if not config.pluginmanager.hasplugin("benchmark"):  # bench_gpu.py's stand-in fixture reads it
        config.addinivalue_line("markers", "benchmark(timer=...): the bench's clock (pytest-benchmark)")


@pytest.fixture(scope="session")
def transfer_cluster() -> Iterator[Ranks]:
    holder = Ranks(2)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(scope="session")
def transfer_targets() -> list[str]:
    return _TARGET_LINES


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    peaks = sorted(_MEMORY.peaks.items(), key=lambda item: -item[1])
    if peaks:
        terminalreporter.section("cudarecv bench memory (Pss of the process tree, shared memory once)")
        for case, size in peaks[:8]:
            terminalreporter.write_line(f"{size / 1e9:6.2f} GB  {case}")
    if _TARGET_LINES:
        terminalreporter.section("cudarecv transfer targets (receiver medians)")
        for line in _TARGET_LINES:
            terminalreporter.write_line(line)
