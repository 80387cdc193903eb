"""Helpers that run inside rank processes: meshes, reference training, comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def cpu_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest absolute difference between a sharded model's full parameters and a reference's."""
    ours = dict(model.named_parameters())
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return max((full(ours[k]).detach() - theirs[k].detach()).abs().max().item() for k in ours)


def global_mean(x: torch.Tensor) -> float:
    """Mean over ranks of a per-rank scalar (the data-parallel loss on the global batch)."""
    t = x.detach().clone().reshape(1).float()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
