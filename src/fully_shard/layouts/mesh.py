"""Which ranks a group shards over and on which device it computes."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel mesh of one ``fully_shard`` call.

    ``group``/``world_size``/``rank`` describe the shard dimension (the last mesh dim). On a 2-D
    HSDP mesh ``(replicate, shard)`` the first dimension holds replicas: ``replicate_group`` is
    the process group gradients are all-reduced over after the reduce-scatter.
    """

    mesh: DeviceMesh
    group: dist.ProcessGroup
    world_size: int
    rank: int
    device: torch.device
    replicate_group: Optional[dist.ProcessGroup] = None
    replicate_size: int = 1
    native_avg: bool = False  # the backend averages in-kernel (NCCL's AVG / PreMulSum)
    # `replicate`: a 1-D mesh of replicas, no shard dimension (a shard world of 1; parameters are
    # ``Replicate()`` DTensors on the mesh; gradients are all-reduced over it).
    replicate_only: bool = False
    is_hsdp: bool = field(init=False)  # a replicate group to all-reduce over
    # Ranks that see different data: replicas times shards (the default gradient divisor).
    data_parallel_size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_hsdp", self.replicate_group is not None)
        object.__setattr__(self, "data_parallel_size", self.replicate_size * self.world_size)

    def __deepcopy__(self, memo: dict[int, Any]) -> "MeshInfo":
        return self  # immutable, and names the shared mesh and process groups a copy runs on too

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dimension (what all-gather extensions are given): the mesh
        itself on a 1-D mesh, its last dimension on an HSDP mesh."""
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is None:  # an unnamed 2-D mesh cannot be sliced by name: the whole mesh
            return self.mesh
        return self.mesh[names[-1]]

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        if self.replicate_only:
            return (Replicate(),)
        shard = Shard(shard_dim)
        return (Replicate(), shard) if self.is_hsdp else (shard,)


def default_device_type() -> str:
    """The current accelerator's type if there is one, else ``cpu``.

    Uses ``torch.accelerator`` so that no particular backend (CUDA, XPU, ...) is hard-coded and
    nothing is initialised just by asking.
    """
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else "cpu"


def default_mesh() -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs a process group to shard over, and none is initialised and no mesh was given. "
            "Call torch.distributed.init_process_group(...) first (torchrun sets the environment for it), or "
            "pass mesh=init_device_mesh(device_type, (world_size,))."
        )
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


# Set by `fully_shard.plan.simulate`: meshes made meanwhile compute on the meta device (shapes
# and sizes only), so the real runtime plans a step at any world size without real memory.
SIMULATING: ContextVar[bool] = ContextVar("fully_shard_simulating", default=False)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``: CPU, or the current device of its
    accelerator (the meta device while `fully_shard.plan` simulates)."""
    if SIMULATING.get():
        return torch.device("meta")
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def mesh_info(mesh: Optional[DeviceMesh]) -> MeshInfo:
    mesh = default_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...) expects a DeviceMesh, got {type(mesh).__name__}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard got a {mesh.ndim}-D mesh {mesh.mesh_dim_names or ''}; it shards over a 1-D mesh "
            "(FSDP) or a 2-D (replicate, shard) mesh (HSDP). Pass the data-parallel dimensions, e.g. "
            "mesh['dp'] or mesh['dp_replicate', 'dp_shard'], and tensor-parallel ones to parallelize_module."
        )
    shard_dim = mesh.ndim - 1
    hsdp = mesh.ndim == 2
    return MeshInfo(
        mesh=mesh,
        group=mesh.get_group(shard_dim),
        world_size=mesh.size(shard_dim),
        rank=mesh.get_local_rank(shard_dim),
        device=mesh_device(mesh),
        replicate_group=mesh.get_group(0) if hsdp else None,
        replicate_size=mesh.size(0) if hsdp else 1,
        # "nccl", or "cpu:gloo,cuda:nccl" for a process group made without a backend
        native_avg=mesh.device_type != "cpu" and "nccl" in str(dist.get_backend(mesh.get_group(shard_dim))),
    )


def replicate_info(mesh: Optional[DeviceMesh]) -> MeshInfo:
    """`replicate` on a 1-D mesh: one shard rank (nothing to gather or reduce-scatter), the mesh's
    ranks as replicas (gradients all-reduced over them)."""
    mesh = default_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"replicate(mesh=...) expects a DeviceMesh, got {type(mesh).__name__}.")
    if mesh.ndim != 1:
        raise ValueError(
            f"replicate got a {mesh.ndim}-D mesh {mesh.mesh_dim_names or ''}; it replicates over a 1-D mesh. "
            "Fix: pass the data-parallel dimension, e.g. mesh['dp'] (for replicas of shards use fully_shard "
            "with a 2-D (replicate, shard) mesh)."
        )
    group = mesh.get_group(0)
    return MeshInfo(
        mesh=mesh,
        group=group,  # names the mesh only: a shard world of 1 issues no collective on it
        world_size=1,
        rank=0,
        device=mesh_device(mesh),
        replicate_group=group,
        replicate_size=mesh.size(0),
        native_avg=mesh.device_type != "cpu" and "nccl" in str(dist.get_backend(group)),
        replicate_only=True,
    )


@dataclass(frozen=True)
class PostForwardGroup:
    """``reshard_after_forward=k``: the ``k`` consecutive shard ranks this rank keeps a share with.

    Between forward and backward this rank holds shard-world rows ``[pos * W/k, (pos+1) * W/k)``
    of each parameter, so backward all-gathers over ``group`` (``k`` ranks, e.g. one node)
    instead of the whole shard world.
    """

    group: dist.ProcessGroup
    size: int
    rank: int

    def __deepcopy__(self, memo: dict[int, Any]) -> "PostForwardGroup":
        return self  # a shared process group


def post_forward_groups(info: MeshInfo, size: int) -> PostForwardGroup:
    """Create the ``W / size`` subgroups of ``info``'s shard group and return this rank's.

    ``new_group`` is collective: every rank must call this in the same order (lazy init does).
    """
    ranks = dist.get_process_group_ranks(info.group)
    mine: Optional[dist.ProcessGroup] = None
    for start in range(0, info.world_size, size):
        subgroup = dist.new_group(ranks[start : start + size], use_local_synchronization=False)
        if start <= info.rank < start + size:
            mine = subgroup
    assert mine is not None
    return PostForwardGroup(group=mine, size=size, rank=info.rank % size)


def check_reshard_after_forward(value: object, info: MeshInfo) -> object:
    """``True``/``False``/``None``, or an ``int`` that divides the shard world size."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or info.world_size % value:
        raise ValueError(
            "reshard_after_forward must be True, False, None or an int that divides the shard world size "
            f"{info.world_size} (e.g. the ranks per node), got {value!r}."
        )
    if value == info.world_size:
        return True  # resharding to the whole world is plain resharding
    if value == 1:
        return False  # a group of one keeps everything
    return value
