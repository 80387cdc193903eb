"""Where offloaded shards live (``CPUOffloadPolicy``): the CPU, or the meta device in a simulation
(``fully_shard.plan``). There `allocating` marks host tensors and `to_device` copies with a real op,
so a memory counter tells host bytes from device bytes and sees the host-to-device copies.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_local = threading.local()


def host_device(device: torch.device) -> torch.device:
    """The device offloaded shards live on when the mesh computes on ``device``."""
    return device if device.type == "meta" else torch.device("cpu")


@contextlib.contextmanager
def allocating() -> Iterator[None]:
    """Tensors made inside are the host's (read by `fully_shard.plan.LiveBytes`)."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def is_allocating() -> bool:
    return getattr(_local, "on", False)


def to_device(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """A host shard's copy on ``device``: a fresh tensor on the simulated host (meta on meta), as the
    real copy would be; ``t`` itself on a CPU mesh, which computes on its host."""
    if t.device != device:
        return t.to(device, non_blocking=non_blocking)
    if device.type == "meta" and type(t) is torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t)
    return t
