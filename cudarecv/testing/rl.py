"""A TorchRL policy whose every action says which weights computed it, and the environment it acts in.

Weight-sync tests and benchmarks of TorchRL collectors need to know, from the
collected batches alone, which version each worker acted with, and whether any
action saw half of one. :func:`marker_policy` maps every observation to
``bias + 1000.7071 (big[0] - big[-1]) + 0.3183 (bias - big[0])``: with
:func:`set_marker` giving all its weights one value ``v``, every action is ``v``,
and an action computed while the weights were half overwritten (``bias``,
``big[0]`` and ``big[-1]`` not all of one version, whichever order a copy writes
them in) is none of the values sent (for values a multiple of 0.25 apart, up to
100 apart: the coefficients make every mix land off that grid). Its ``stamp``
output is the monotonic clock (system-wide on Linux) when the action was computed.

Example:
    >>> policy = marker_policy(4_000_000)   # about 4 MB of weights
    >>> set_marker(policy, 0.5)
    >>> collector.update_policy_weights_()
    >>> markers(next(iter(collector)))     # {0.5}
"""

from __future__ import annotations

import socket
import time

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import PendulumEnv

__all__ = ["free_ports", "make_env", "marker_policy", "markers", "set_marker", "stamps"]


class _Marker(nn.Module):
    def __init__(self, floats: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.big = nn.Parameter(torch.zeros(max(floats, 2)))

    def forward(self, th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = (
            self.big[0],
            self.big[-1],
        )  # a copy in place writes big front to back, bias before or after
        action = (self.bias + 1000.7071 * (first - last) + 0.3183 * (self.bias - first)).expand(
            *th.shape, 1
        )
        return action, torch.full(th.shape, time.monotonic(), dtype=torch.float64)


def make_env() -> PendulumEnv:
    """The environment of the tests (pure torch, nothing to download)."""
    return PendulumEnv()


def marker_policy(nbytes: int = 4096) -> TensorDictModule:
    """A policy of about ``nbytes`` bytes of float32 weights (``th`` in, ``action`` and ``stamp`` out)."""
    return TensorDictModule(_Marker(nbytes // 4), in_keys=["th"], out_keys=["action", "stamp"])


def set_marker(policy: TensorDictModule, value: float) -> None:
    """Give every weight of ``policy`` the value ``value``: its actions are then ``value``."""
    with torch.no_grad():
        for weight in policy.parameters():
            weight.fill_(value)


def markers(batch: TensorDictBase) -> set[float]:
    """The values the actions of ``batch`` were computed with (rounded to float32's precision)."""
    return {round(v, 5) for v in batch["action"].flatten().tolist()}


def stamps(batch: TensorDictBase, value: float) -> list[float]:
    """When each action of ``batch`` computed with ``value`` was computed (``time.monotonic()``)."""
    action, stamp = batch["action"].flatten(), batch["stamp"].flatten()
    return stamp[(action - value).abs() < 1e-5].tolist()


def free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 (``DistributedCollector(tcp_port=p)`` takes three in a row)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free ports in a row on 127.0.0.1")
