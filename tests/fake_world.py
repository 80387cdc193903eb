"""Run code in this process as rank ``rank`` of a fake world of ``world_size`` (no real comms)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
