"""Which ranks a group shards over and on which device it computes."""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

# torch 2.13 renamed the flat-tensor all-gather; 2.11 only has the old name (as runtime/collectives.py)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel mesh of one ``fully_shard`` call.

    ``group``/``world_size``/``rank`` describe the shard dim (the last mesh dim). On a 2-D HSDP mesh
    ``(replicate, shard)``, gradients are all-reduced over ``replicate_group`` after the reduce-scatter.
    """

    mesh: DeviceMesh
    group: dist.ProcessGroup
    world_size: int
    rank: int
    device: torch.device
    replicate_group: Optional[dist.ProcessGroup] = None
    replicate_size: int = 1
    native_avg: bool = False  # the backend averages in-kernel (NCCL's AVG / PreMulSum)
    replicate_only: bool = False  # `replicate`: a shard world of 1, parameters are Replicate() DTensors
    plain: bool = False  # `replicate(plain_params=True)`: plain tensors instead (FSDP1's NO_SHARD, DDP)
    is_hsdp: bool = field(init=False)
    data_parallel_size: int = field(init=False)  # replicas x shards: the default gradient divisor

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_hsdp", self.replicate_group is not None)
        object.__setattr__(self, "data_parallel_size", self.replicate_size * self.world_size)

    def __deepcopy__(self, memo: dict[int, Any]) -> "MeshInfo":
        return self  # a deep-copied module runs on the same mesh and process groups

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (what all-gather extensions are given)."""
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is None:  # an unnamed 2-D mesh cannot be sliced by name
            return self.mesh
        return self.mesh[names[-1]]

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        if self.replicate_only:
            return (Replicate(),)
        shard = Shard(shard_dim)
        return (Replicate(), shard) if self.is_hsdp else (shard,)


def default_device_type() -> str:
    """The current accelerator's type, else ``cpu`` (no backend hard-coded, nothing initialised)."""
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


# Set by `fully_shard.plan.simulate`: meshes made meanwhile compute on the meta device, so a step
# can be planned at any world size without real memory.
SIMULATING: ContextVar[bool] = ContextVar("fully_shard_simulating", default=False)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device for ``mesh``: CPU, the accelerator's current device, or meta (simulating)."""
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


def replicate_info(mesh: Optional[DeviceMesh], plain: bool = False) -> MeshInfo:
    """`replicate` on a 1-D mesh: a shard world of 1, the mesh's ranks as replicas."""
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
        plain=plain,
    )


@dataclass(frozen=True)
class PostForwardGroup:
    """``reshard_after_forward=k``: the ``k`` consecutive shard ranks this rank keeps a share with,
    so backward all-gathers over ``group`` (e.g. one node) instead of the whole shard world.
    ``across``: the ranks at this rank's position in every such group (the traced path gathers
    over it first, keeping what ``group`` gathers again in backward)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    across: dist.ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> "PostForwardGroup":
        return self  # a shared process group


_POST_FORWARD: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, PostForwardGroup]]"
_POST_FORWARD = weakref.WeakKeyDictionary()


def post_forward_groups(info: MeshInfo, size: int) -> PostForwardGroup:
    """This rank's smaller groups of ``info``'s shard group, made once per (shard group, size) by
    ``fully_shard`` (a graph cannot make them). Only their members make each (local
    synchronisation): shard groups that are not the whole world make theirs independently."""
    made = _POST_FORWARD.setdefault(info.group, {})
    if size not in made:
        _align_group_counts(info)
        ranks = dist.get_process_group_ranks(info.group)
        start, pos = info.rank - info.rank % size, info.rank % size
        group = dist.new_group(ranks[start : start + size], use_local_synchronization=True)
        across = dist.new_group(ranks[pos::size], use_local_synchronization=True)
        made[size] = PostForwardGroup(group=group, size=size, rank=pos, across=across)
    return made[size]


@dataclass(frozen=True)
class ReduceScatterGroup:
    """`FSDPModule.set_separate_reduce_scatter_group`: a second process group over a shard group's
    ranks, on which the reduce-scatters run, so that they can progress beside the all-gathers (one
    NCCL communicator, or one gloo context, serves its collectives one at a time)."""

    group: dist.ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> "ReduceScatterGroup":
        return self  # a shared process group


_REDUCE_SCATTER: "weakref.WeakKeyDictionary[dist.ProcessGroup, ReduceScatterGroup]"
_REDUCE_SCATTER = weakref.WeakKeyDictionary()


def reduce_scatter_group(info: MeshInfo) -> Optional[ReduceScatterGroup]:
    """The reduce-scatter's own group over ``info``'s shard ranks, made once per shard group (by its
    members only: local synchronisation, as `post_forward_groups`); None where no reduce-scatter
    runs (one shard rank, a simulated mesh)."""
    if info.world_size == 1 or info.device.type == "meta":
        return None
    made = _REDUCE_SCATTER.get(info.group)
    if made is None:
        _align_group_counts(info)
        ranks = dist.get_process_group_ranks(info.group)
        pg = dist.new_group(ranks, use_local_synchronization=True, group_desc="fully_shard_reduce_scatter")
        made = _REDUCE_SCATTER[info.group] = ReduceScatterGroup(pg)
    return made


def _align_group_counts(info: MeshInfo) -> None:
    """torch names a group made with local synchronisation after its ranks and the number of
    groups the calling rank already belongs to (``distributed_c10d._hash_ranks_to_str``): members
    that joined different numbers of groups before (a ``dist.new_group`` over some ranks only, which
    the others call without joining) would name one group differently and wait for each other
    until the timeout. So the members of the shard group first agree on that number (one small
    all-gather), and those below the largest join groups of their own rank alone (no
    communication) until they reach it."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None or info.device.type == "meta":  # no such table in this torch; a simulation
        return
    mine = torch.tensor([len(names)], dtype=torch.int64, device=info.device)
    counts = mine.repeat(info.world_size)
    _all_gather_flat(counts, mine, group=info.group)
    for _ in range(int(counts.max().item()) - len(names)):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def is_across_group(name: str) -> bool:
    """Whether ``name`` is a live `PostForwardGroup.across` group's (the traced path saves what
    gathers over it)."""
    return any(pf.across.group_name == name for made in _POST_FORWARD.values() for pf in made.values())


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


def dtensor_in_place(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> Any:
    """A DTensor around ``local`` on the device ``local`` is on. ``DTensor.from_local`` moves a
    local tensor to the mesh's device type: an offloaded (host) shard on a CUDA mesh would be
    copied to the GPU, and its ``.grad`` refused for the device mismatch."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]
