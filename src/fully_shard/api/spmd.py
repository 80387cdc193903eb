"""``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: a full SPMD mesh
(data-parallel dims and others, e.g. tensor parallel), as torchtitan passes it.

The named data-parallel dims become the mesh to shard over (``shard`` only: FSDP; both: HSDP; a
tuple of names is flattened). Parameters already DTensors on the full mesh must be ``Replicate()``
on those dims; each is re-expressed, same local tensor, on the sub-mesh of the other dims (the
tensor-parallel form `fully_shard` composes with), or as a plain tensor if replicated everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..runtime.registry import manager_of

Names = Union[str, tuple[str, ...], None]


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel (PyTorch's ``DataParallelMeshDims``)."""

    shard: Names = None
    replicate: Names = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims needs at least one of shard= or replicate= (mesh dim names)."
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: Names) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def as_dp_mesh_dims(value: Any) -> DataParallelMeshDims:
    """Ours as is; PyTorch's ``DataParallelMeshDims`` (recognised by its fields) converted."""
    if isinstance(value, DataParallelMeshDims):
        return value
    if (
        type(value).__name__ == "DataParallelMeshDims"
        and hasattr(value, "shard")
        and hasattr(value, "replicate")
    ):
        return DataParallelMeshDims(shard=value.shard, replicate=value.replicate)
    raise TypeError(
        "dp_mesh_dims must be a fully_shard.DataParallelMeshDims (PyTorch's is converted), got "
        f"{type(value).__name__}."
    )


def _dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    sub = mesh[names[0]] if len(names) == 1 else mesh[names]
    return sub if sub.ndim == 1 else sub._flatten("_".join(names))


def _flat_name(mesh: DeviceMesh, names: tuple[str, ...]) -> str:
    """The name of one dim standing for ``names``: flattening registers it on the full mesh, so it
    can be sliced together with another dim."""
    if len(names) == 1:
        return names[0]
    return _dim(mesh, names).mesh_dim_names[0]  # type: ignore[index]


def to_dp_mesh(
    modules: list[nn.Module], mesh: Optional[DeviceMesh], dp_mesh_dims: Any
) -> tuple[Optional[DeviceMesh], list[tuple[nn.Module, str, nn.Parameter]]]:
    """The mesh to shard over and, with ``dp_mesh_dims``, the parameters `localize_params` replaced."""
    if dp_mesh_dims is None:
        return mesh, []
    dims = as_dp_mesh_dims(dp_mesh_dims)
    dp, others = dp_mesh(mesh, dims)
    dp_names = dims.replicate_names + dims.shard_names
    return dp, localize_params(modules, mesh, dp_names, others)  # type: ignore[arg-type]


def dp_mesh(mesh: Optional[DeviceMesh], dims: DataParallelMeshDims) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The data-parallel mesh to shard over, and the names of the full mesh's other dims."""
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        raise ValueError(
            "fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD mesh with named dims, e.g. "
            "init_device_mesh(device, (2, 2), mesh_dim_names=('dp', 'tp'))."
        )
    names = tuple(mesh.mesh_dim_names)
    dp = dims.replicate_names + dims.shard_names
    unknown = [n for n in dp if n not in names]
    if unknown or len(set(dp)) != len(dp):
        raise ValueError(
            f"dp_mesh_dims names {list(dp)}, but the mesh's dims are {list(names)} (each dp dim once). Fix: "
            "name dims of the mesh you pass."
        )
    others = tuple(n for n in names if n not in dp)
    if dims.replicate_names and dims.shard_names:
        order = [names.index(n) for n in dp]
        if order != sorted(order):
            raise ValueError(
                "dp_mesh_dims: HSDP needs the replicate dims before the shard dims in the mesh's order, "
                f"each side's dims in order; got replicate={list(dims.replicate_names)}, "
                f"shard={list(dims.shard_names)} on a mesh with dims {list(names)}. Fix: build the mesh with "
                "its dims in that order."
            )
        return mesh[_flat_name(mesh, dims.replicate_names), _flat_name(mesh, dims.shard_names)], others
    if dims.replicate_names:
        raise ValueError(
            "dp_mesh_dims with replicate= only is data parallelism without sharding: use replicate(module, "
            "mesh=mesh[...]) (fully_shard.replicate)."
        )
    return _dim(mesh, dims.shard_names), others


def localize_params(
    modules: list[nn.Module], mesh: DeviceMesh, dp_names: tuple[str, ...], others: tuple[str, ...]
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Re-express the parameters that are DTensors on the full ``mesh`` (see the module docstring).
    Returns what it replaced, for `restore`."""
    changes: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    seen: dict[int, nn.Parameter] = {}
    for top in modules:
        for module in top.modules():
            for attr, param in list(module._parameters.items()):
                # skip plain ones, those on another mesh, and those an earlier call sharded
                if isinstance(param, DTensor) and param.device_mesh == mesh and manager_of(param) is None:
                    if id(param) not in seen:
                        seen[id(param)] = _localized(param, attr, module, mesh, dp_names, others)
                    changes.append((module, attr, param, seen[id(param)]))
    for module, attr, _, new in changes:
        module._parameters[attr] = new
    return [(module, attr, old) for module, attr, old, _ in changes]


def _localized(
    param: DTensor,
    attr: str,
    module: nn.Module,
    mesh: DeviceMesh,
    dp_names: tuple[str, ...],
    others: tuple[str, ...],
) -> nn.Parameter:
    """``param`` on the sub-mesh of ``others``, same local tensor; plain if replicated there too."""
    placements = dict(zip(mesh.mesh_dim_names or (), param.placements))
    wrong = [n for n in dp_names if not isinstance(placements[n], Replicate)]
    if wrong:
        raise ValueError(
            f"parameter '{attr}' of {type(module).__name__} is a DTensor on the full mesh with "
            f"placements {tuple(param.placements)}: on the data-parallel dims {wrong} it must be "
            "Replicate() (fully_shard shards it there). Fix: distribute it over the "
            "non-data-parallel dims only."
        )
    local = param.to_local().detach()
    rest = [placements[n] for n in others]
    if all(isinstance(p, Replicate) for p in rest):
        return nn.Parameter(local, requires_grad=param.requires_grad)
    sub = mesh[others[0]] if len(others) == 1 else mesh[others]
    dt = DTensor.from_local(local, sub, rest, shape=param.shape, stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def restore(changes: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for module, attr, old in changes:
        module._parameters[attr] = old
