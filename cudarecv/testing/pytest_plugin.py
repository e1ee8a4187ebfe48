"""pytest plugin: ``--gpus N`` and the ``gpus(k)`` marker.

A test marked ``@pytest.mark.gpus(k)`` runs only when pytest is given
``--gpus N`` with ``k <= N``; otherwise it is skipped with a reason saying how
to run it.  Asking for more GPUs than NVML sees is a usage error, so a GPU CI
job on a machine that lost its GPUs fails loudly instead of skipping
everything.  GPUs are counted with NVML, never by initializing CUDA, so the
plugin is fork-safe.  Unmarked tests are untouched.

Opt-in: pass ``-p cudarecv.testing.pytest_plugin``, or name it in a conftest
(``pytest_plugins = ["cudarecv.testing.pytest_plugin"]``, as cudarecv's own does).
No entry point loads it, so installing cudarecv changes no other project's test run.
"""

from __future__ import annotations

import os

import pytest

from . import nvml

MARKER = "gpus"
MARKER_HELP = "gpus(k): test needs k GPUs; runs only with --gpus N where k <= N"

_nvml_count_key = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cudarecv", "cudarecv GPU tests")
    group.addoption(
        "--gpus",
        type=int,
        default=0,
        metavar="N",
        dest="cudarecv_gpus",
        help=(
            "number of GPUs the run may use (default 0): tests marked gpus(k) "
            "run only when k <= N; N above what NVML sees is an error"
        ),
    )


def requested_gpus(config: pytest.Config) -> int:
    """The ``--gpus`` value of this run."""
    return int(config.getoption("cudarecv_gpus", 0) or 0)


def nvml_gpus(config: pytest.Config) -> int:
    """GPUs NVML sees, counted once per run."""
    if _nvml_count_key not in config.stash:
        config.stash[_nvml_count_key] = nvml.gpu_count()
    return config.stash[_nvml_count_key]


def cuda_visible_limit() -> int | None:
    """How many devices ``CUDA_VISIBLE_DEVICES`` lets CUDA use; None if unset.

    Like CUDA, stop at the first empty or negative entry.  NVML itself ignores
    this variable, so it caps the NVML count.
    """
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    count = 0
    for entry in value.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        count += 1
    return count


def usable_gpus(config: pytest.Config) -> int:
    """GPUs NVML sees, capped by ``CUDA_VISIBLE_DEVICES`` when it is set."""
    limit = cuda_visible_limit()
    seen = nvml_gpus(config)
    return seen if limit is None else min(seen, limit)


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _seen_text(config: pytest.Config) -> str:
    text = f"NVML sees {nvml_gpus(config)} GPU(s)"
    limit = cuda_visible_limit()
    return text if limit is None else f"{text}, CUDA_VISIBLE_DEVICES allows {limit}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    wanted = requested_gpus(config)
    if wanted < 0:
        raise pytest.UsageError(f"--gpus {wanted}: the GPU count cannot be negative")
    usable = usable_gpus(config)
    if wanted > usable:
        fewer = f" (or at most {usable})" if usable else ""
        raise pytest.UsageError(
            f"--gpus {wanted} asks for {_gpus(wanted)} but {_seen_text(config)} on this "
            f"machine: pass --gpus 0{fewer} to skip the tests marked gpus(k) with k above "
            "it, or run where `nvidia-smi` lists enough GPUs"
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"cudarecv: --gpus {requested_gpus(config)}, {_seen_text(config)}"]
    if requested_gpus(config) > 0:
        lines += nvml.format_topology(nvml.topology()).splitlines()
    return lines


def needed_gpus(item: pytest.Item) -> int:
    """Largest ``k`` among the item's ``gpus(k)`` markers (0 when unmarked).

    Raises :class:`pytest.UsageError` for a marker that is not ``gpus(k)``
    with one non-negative int ``k``.
    """
    needed = 0
    for mark in item.iter_markers(MARKER):
        k = mark.args[0] if len(mark.args) == 1 and not mark.kwargs else None
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise pytest.UsageError(
                f"{item.nodeid}: bad marker {_describe(mark)}; expected one "
                "non-negative int, e.g. @pytest.mark.gpus(2)"
            )
        needed = max(needed, k)
    return needed


def _describe(mark: pytest.Mark) -> str:
    args = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"@pytest.mark.{mark.name}({', '.join(args)})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = requested_gpus(config)
    for item in items:
        needed = needed_gpus(item)
        if needed > available:
            reason = f"needs {_gpus(needed)}; run with --gpus {needed}"
            item.add_marker(pytest.mark.skip(reason=f"{reason} (this run: --gpus {available})"))
