"""Tensor parallelism under ``fully_shard``: a parameter that is already a DTensor on a TP mesh.

Its TP-local tensor is sharded over the data-parallel mesh: the sharded parameter is a DTensor on
the joint ``(dp..., tp)`` mesh, the unsharded one a DTensor on the TP mesh again (what the TP module
expects), and its gradient goes back to the TP placements before the reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class TPSpec:
    """How a tensor-parallel parameter was distributed before ``fully_shard`` saw it."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # global (TP) shape
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: DTensor) -> "TPSpec":
        return cls(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))

    def __deepcopy__(self, memo: dict[int, Any]) -> "TPSpec":
        return self  # immutable, and names a shared mesh

    def joint(
        self, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """Mesh and placements of the sharded parameter: data-parallel dims, then the TP ones.
        When TP shards the same dim first, the data-parallel chunks live inside each TP chunk."""
        split = 1
        for p, size in zip(self.placements, self.mesh.shape):
            if isinstance(p, Shard) and p.dim == shard_dim:
                split *= size
        if split > 1:
            dp_placements = (*dp_placements[:-1], _StridedShard(shard_dim, split_factor=split))
        return joint_mesh(dp_mesh, self.mesh), (*dp_placements, *self.placements)

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """The TP-local unsharded tensor as the DTensor the TP module computes with."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The TP-local gradient (e.g. Partial -> Replicate first)."""
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(placements=self.placements)
        return grad.to_local()


def joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh two slices of one parent mesh span together."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([dp_mesh, tp_mesh])
    names = (*(dp_mesh.mesh_dim_names or ()), *(tp_mesh.mesh_dim_names or ()))
    return dp_mesh._get_root_mesh()[names]
