"""GPU discovery through NVML only.

Nothing here initializes CUDA, so these functions are safe to call in a parent
process that later forks workers (pytest, torch.multiprocessing). Every entry
point opens its own NVML session and always closes it. A machine without
``pynvml`` or without the NVML library counts as having no GPUs, and a single
query the driver refuses (old GPU, no NVLink, MIG, ...) yields ``None``/``0``
for that field instead of failing the whole call.

Run ``python -m cudarecv.testing.nvml`` to print the table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["GpuInfo", "format_topology", "gpu_count", "topology"]

T = TypeVar("T")

# nvmlDeviceGetTopologyCommonAncestor levels -> the abbreviations nvidia-smi
# ``topo -m`` prints.  INTERNAL means both GPUs sit on one board.
_ANCESTOR_NAMES: dict[int, str] = {
    0: "INT",  # NVML_TOPOLOGY_INTERNAL
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: one PCIe switch
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe switches
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: a PCIe host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: host bridges within one NUMA node
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across NUMA nodes (SMP interconnect)
}
UNKNOWN = "?"


@dataclass(frozen=True)
class GpuInfo:
    """What NVML reports about one GPU; ``None`` where a query failed."""

    index: int
    name: str | None
    uuid: str | None
    memory_bytes: int | None
    pcie_gen: int | None
    pcie_width: int | None
    nvlinks_active: int = 0
    peers: dict[int, str] = field(default_factory=dict)


def _pynvml() -> ModuleType | None:
    """The ``pynvml`` module, or ``None`` when it is not installed."""
    try:
        import pynvml
    except Exception:  # ImportError, or a broken install
        return None
    return pynvml


@contextlib.contextmanager
def _session() -> Iterator[ModuleType | None]:
    """Yield initialized ``pynvml`` (or ``None``); always shut NVML down."""
    nvml = _pynvml()
    if nvml is None:
        yield None
        return
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        yield None
        return
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _try(query: Callable[..., T], *args: Any) -> T | None:
    """``query(*args)``, or ``None`` if NVML raises."""
    try:
        return query(*args)
    except Exception:
        return None


def _text(value: str | bytes | None) -> str | None:
    """Older pynvml releases return ``bytes`` for strings."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


def _count(nvml: ModuleType) -> int:
    return int(_try(nvml.nvmlDeviceGetCount) or 0)


def gpu_count() -> int:
    """Number of GPUs NVML sees; 0 when pynvml or NVML is unavailable."""
    with _session() as nvml:
        return 0 if nvml is None else _count(nvml)


def _memory_bytes(nvml: ModuleType, handle: Any) -> int | None:
    info = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
    return None if info is None else int(info.total)


def _nvlinks_active(nvml: ModuleType, handle: Any) -> int:
    """Links whose state is enabled; unsupported or missing links count 0."""
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    return sum(
        _try(nvml.nvmlDeviceGetNvLinkState, handle, link) == enabled for link in range(max_links)
    )


def _peer_relation(nvml: ModuleType, handle: Any, other: Any) -> str:
    """``"NVLink"`` when P2P over NVLink works, else the common PCIe ancestor."""
    nvlink_index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    status = _try(nvml.nvmlDeviceGetP2PStatus, handle, other, nvlink_index)
    if status is not None and status == getattr(nvml, "NVML_P2P_STATUS_OK", 0):
        return "NVLink"
    level = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, handle, other)
    return UNKNOWN if level is None else _ANCESTOR_NAMES.get(level, UNKNOWN)


def _peers(nvml: ModuleType, index: int, found: dict[int, Any]) -> dict[int, str]:
    """Relation of GPU ``index`` to every other GPU (``"?"`` if it has no handle)."""
    handle = found[index]
    return {
        j: UNKNOWN if handle is None or other is None else _peer_relation(nvml, handle, other)
        for j, other in found.items()
        if j != index
    }


def _info(nvml: ModuleType, index: int, found: dict[int, Any]) -> GpuInfo:
    """Everything about GPU ``index``; its handle ``found[index]`` is not None."""
    handle = found[index]
    pcie_gen = _try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    pcie_width = _try(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
    return GpuInfo(
        index=index,
        name=_text(_try(nvml.nvmlDeviceGetName, handle)),
        uuid=_text(_try(nvml.nvmlDeviceGetUUID, handle)),
        memory_bytes=_memory_bytes(nvml, handle),
        pcie_gen=None if pcie_gen is None else int(pcie_gen),
        pcie_width=None if pcie_width is None else int(pcie_width),
        nvlinks_active=_nvlinks_active(nvml, handle),
        peers=_peers(nvml, index, found),
    )


def topology() -> list[GpuInfo]:
    """One :class:`GpuInfo` per GPU NVML sees; ``[]`` without NVML.

    A GPU whose handle cannot be had still gets an entry (all ``None``), and
    appears as ``"?"`` in the other GPUs' ``peers``.
    """
    with _session() as nvml:
        if nvml is None:
            return []
        found = {i: _try(nvml.nvmlDeviceGetHandleByIndex, i) for i in range(_count(nvml))}
        return [
            _unknown(nvml, i, found) if handle is None else _info(nvml, i, found)
            for i, handle in found.items()
        ]


def _unknown(nvml: ModuleType, index: int, found: dict[int, Any]) -> GpuInfo:
    """Entry for a GPU whose NVML handle could not be had."""
    return GpuInfo(index, None, None, None, None, None, 0, _peers(nvml, index, found))


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _row(info: GpuInfo, indices: list[int]) -> list[str]:
    mem = None if info.memory_bytes is None else f"{info.memory_bytes / 2**30:.1f}"
    pcie = None
    if info.pcie_gen is not None or info.pcie_width is not None:
        pcie = f"gen{_cell(info.pcie_gen)} x{_cell(info.pcie_width)}"
    peers = ["X" if j == info.index else info.peers.get(j, UNKNOWN) for j in indices]
    cells = [_cell(info.name), _cell(mem), _cell(pcie), str(info.nvlinks_active)]
    return [f"GPU{info.index}", *cells, *peers]


def format_topology(infos: list[GpuInfo]) -> str:
    """A plain-text table: one row per GPU, then its relation to each GPU."""
    if not infos:
        return "NVML sees no GPUs"
    from . import table

    indices = [info.index for info in infos]
    header = ["", "name", "mem GiB", "PCIe", "NVLinks", *(f"GPU{j}" for j in indices)]
    rows = [dict(zip(header, _row(info, indices))) for info in infos]
    return table.text(header, {None: rows}, left=set(header), commented=False).rstrip("\n")


if __name__ == "__main__":
    print(format_topology(topology()))
