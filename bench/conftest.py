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

Memory: a thread samples this process and its descendants every 0.5 s
(:class:`cudarecv.tools.bench_memory.TreeMemory`: the sum of their ``Pss``, so memory shared
between processes counts once); the run ends with the cases of the highest peaks, highest first
(a case shorter than a sample may have none).

Fixtures: ``transfer_cluster``, a :class:`cudarecv.testing.launch.Ranks` of 2 ranks
for the whole session (started when a bench first asks for it), restarted if a
failure closed it; ``transfer_targets``, a list of lines printed at the end of
the run (the transfer benches' target ratios).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudarecv.testing.launch import Ranks
from cudarecv.tools.bench_memory import TreeMemory

_TARGET_LINES: list[str] = []


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
        config.addinivalue_line(
            "markers", "benchmark(timer=...): the bench's clock (pytest-benchmark)"
        )


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
        terminalreporter.section(
            "cudarecv bench memory (Pss of the process tree, shared memory once)"
        )
        for case, size in peaks[:8]:
            terminalreporter.write_line(f"{size / 1e9:6.2f} GB  {case}")
    if _TARGET_LINES:
        terminalreporter.section("cudarecv transfer targets (receiver medians)")
        for line in _TARGET_LINES:
            terminalreporter.write_line(line)
