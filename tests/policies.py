"""A small policy whose every value encodes a version, for weight-sync tests."""

from __future__ import annotations

import torch


def policy(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 4),
    )


def set_version(model: torch.nn.Module, version: int) -> None:
    """Give every parameter and buffer a value that encodes ``version``."""
    with torch.no_grad():
        for i, t in enumerate(list(model.parameters()) + list(model.buffers())):
            t.copy_(torch.full_like(t, version * 1000 + i))


def holds_version(td_or_model, version: int, hidden: int = 16) -> bool:
    """Whether every value of a received tensordict (or a module) encodes ``version``."""
    if isinstance(td_or_model, torch.nn.Module):
        tensors = list(td_or_model.parameters()) + list(td_or_model.buffers())
    else:
        model = policy(hidden)
        tensors = [
            td_or_model.get(tuple(n.split(".")))
            for n, _ in list(model.named_parameters()) + list(model.named_buffers())
        ]
    return all(
        torch.equal(t, torch.full_like(t, version * 1000 + i)) for i, t in enumerate(tensors)
    )
