"""Which parameters one ``fully_shard`` call manages, and the checks on them.

Everything here only reads the model, so a call that fails a check leaves it untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..layouts.layout import FLAT
from ..layouts.mesh import MeshInfo
from ..layouts.tp import joint_mesh
from ..runtime.param import FSDPParam, ParamPlace
from ..runtime.registry import manager_of


def is_sharded_module(module: nn.Module) -> bool:
    return "_fsdp_state" in module.__dict__


def _walk(module: nn.Module, fqn: str, seen: set[int]) -> Iterator[tuple[nn.Module, str]]:
    """Modules this call manages: pre-order, stopping at modules an earlier call already sharded."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield module, fqn
    for name, child in module._modules.items():
        if child is not None and not is_sharded_module(child):
            yield from _walk(child, f"{fqn}.{name}" if fqn else name, seen)


def _label(module: nn.Module, fqn: str) -> str:
    """How an error names the module holding a parameter: its path, or its class at the top."""
    if fqn:
        return f"module '{fqn}'"
    cls = getattr(type(module), "_fsdp_original_class", type(module))
    return f"this {cls.__name__}"


@dataclass
class Found:
    """``own``: each parameter the call manages, with every place it is registered; ``borrowed``:
    parameters earlier calls manage that its modules also use (tied weights)."""

    own: list[tuple[nn.Parameter, list[ParamPlace]]]
    borrowed: list[tuple[FSDPParam, list[ParamPlace]]]


def find_params(modules: list[nn.Module], module_names: list[str], ignored: set[int]) -> Found:
    own: dict[int, tuple[nn.Parameter, list[ParamPlace]]] = {}
    borrowed: dict[int, tuple[FSDPParam, list[ParamPlace]]] = {}
    seen: set[int] = set()
    walked = [(m, fqn) for top, name in zip(modules, module_names) for m, fqn in _walk(top, name, seen)]
    walked_ids = {id(m) for m, _ in walked}
    for module, module_fqn in walked:
        if isinstance(module, torch.jit.ScriptModule) and any(
            id(p) not in ignored for p in module.parameters()
        ):
            _refuse_script_module(_label(module, module_fqn))
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            place = ParamPlace(module, name, fqn)
            owner = manager_of(param)
            if owner is not None:
                if any(id(p.module) in walked_ids for p in owner.places):
                    _refuse_parent_first(fqn, _label(module, module_fqn))
                borrowed.setdefault(id(owner), (owner, []))[1].append(place)
                continue
            own.setdefault(id(param), (param, []))[1].append(place)
    return Found(list(own.values()), list(borrowed.values()))


def warn_uneven_complex(
    own: list[tuple[nn.Parameter, list[ParamPlace]]], shard_dims: list[int], infos: list[MeshInfo]
) -> None:
    """Warn about trainable complex parameters sharded unevenly: Adam / AdamW would never update them."""
    for (param, places), dim, info in zip(own, shard_dims, infos):
        size = param.numel() if dim == FLAT else param.shape[dim] if param.dim() else 0
        if param.is_complex() and param.requires_grad and size % info.world_size:
            warnings.warn(
                f"parameter '{places[0].fqn}' is complex with {'numel' if dim == FLAT else f'dim {dim}'} "
                f"of size {size}, which "
                f"does not divide evenly over {info.world_size} ranks. torch.optim's Adam/AdamW update "
                "complex parameters through view_as_real, which on an unevenly sharded DTensor returns a "
                "copy, so they would never update it (SGD is fine). Fix: pad that dim to a multiple of the "
                "shard world size, or shard another dim with shard_placement_fn.",
                stacklevel=3,
            )


def _refuse_script_module(where: str) -> None:
    raise ValueError(
        f"fully_shard cannot manage the parameters of {where}: it is a TorchScript module (torch.jit.script "
        "/ trace), which keeps its parameters and forward in C++ where they cannot be swapped for shards or "
        "hooked. Fix: apply fully_shard to the eager module (and use torch.compile for speed), or leave "
        "this module's parameters out with ignored_params=set(module.parameters()) (they then stay "
        "replicated and are not synchronised)."
    )


def _refuse_parent_first(fqn: str, where: str) -> None:
    raise ValueError(
        f"parameter '{fqn}' (in {where}) is already a DTensor managed by an earlier fully_shard call on a "
        "parent module. Fix: apply fully_shard bottom-up (inner blocks first, the root last)."
    )


def _one_parent(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> bool:
    """Whether the two meshes are slices of one parent that together span a joint (dp..., tp) mesh."""
    try:
        joint = joint_mesh(dp_mesh, tp_mesh)
    except Exception:  # DeviceMesh refuses to join them
        return False
    return joint.ndim == dp_mesh.ndim + 1 and joint.size() == dp_mesh.size() * tp_mesh.size()


def _check_tp_param(param: DTensor, fqn: str, info: MeshInfo) -> None:
    """Accept a DTensor fully_shard did not make only as a tensor-parallel parameter on another dim
    of the data-parallel mesh's parent."""
    tp_mesh = param.device_mesh
    rule = (
        f"parameter '{fqn}' is already a DTensor (placements {tuple(param.placements)} on mesh "
        f"{tp_mesh.mesh_dim_names or tuple(tp_mesh.shape)}) that fully_shard did not make. fully_shard "
        "composes with tensor parallelism when the parameter lives on the 'tp' dimension and the "
        "fully_shard mesh is the 'dp' dimension of one parent mesh, e.g. mesh = init_device_mesh(device, "
        "(dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(model, mesh['tp'], plan); "
        "fully_shard(model, mesh=mesh['dp'])."
    )
    if (
        tp_mesh.ndim != 1
        or tp_mesh == info.mesh
        or not _one_parent(info.mesh, tp_mesh)
        or not tp_mesh.mesh_dim_names
        or not info.mesh.mesh_dim_names
    ):
        raise ValueError(
            f"{rule} Fix: shard plain parameters, or use named sub-meshes of one parent mesh as shown."
        )
    if any(not isinstance(p, (Shard, Replicate)) for p in param.placements):
        raise ValueError(f"{rule} Its placements must be Shard or Replicate, got {tuple(param.placements)}.")


def check_param(param: nn.Parameter, fqn: str, info: MeshInfo) -> None:
    """Refuse a parameter this version cannot shard correctly, naming it and the fix."""
    if isinstance(param, DTensor):
        if info.plain:
            raise ValueError(
                f"parameter '{fqn}' is a DTensor (placements {tuple(param.placements)}), and "
                "replicate(plain_params=True) exposes parameters as plain tensors, which cannot carry its "
                "layout. Fix: replicate it with plain_params=False (Replicate() DTensors)."
            )
        _check_tp_param(param, fqn, info)
    if param.dim() == 0:
        raise ValueError(
            f"parameter '{fqn}' is a 0-dim scalar; fully_shard shards on dim 0. Fix: store it with shape "
            "(1,) (e.g. nn.Parameter(value.reshape(1))), or pass it in ignored_params and keep it in "
            "sync yourself."
        )
    if not param.is_meta and not _device_usable(param.device, info.device):
        raise ValueError(
            f"parameter '{fqn}' is on {param.device}, but the mesh computes on {info.device}. Fix: move "
            f"the module to {info.device} (or to CPU) before fully_shard, or pass a mesh on "
            f"{param.device.type}."
        )
    if not (param.is_floating_point() or param.is_complex()) and param.requires_grad:
        raise ValueError(
            f"parameter '{fqn}' has dtype {param.dtype} and requires grad, but only floating-point and "
            "complex tensors have gradients. Fix: set requires_grad=False on it (it is then gathered, "
            "never reduced), or make it a buffer."
        )


def _device_usable(device: torch.device, mesh_device: torch.device) -> bool:
    # CPU parameters are moved to the mesh's device shard by shard
    return device.type == "cpu" or (mesh_device.type != "cpu" and device == mesh_device)


def move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    for top in modules:
        for module in top.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


@dataclass(frozen=True)
class FlatShard:
    """What ``shard_placement_fn`` may return to shard a parameter **flattened**: rank ``r`` holds
    elements ``[r * c, (r + 1) * c)`` of ``param.flatten()``, ``c = ceil(numel / W)``, so at most
    ``W - 1`` elements of padding instead of up to a row per rank (a 2,048-row weight at 4,096
    ranks: 1.0x the bytes instead of 2.0x). Between steps the module, the optimizer and
    ``model.parameters()`` see a 1-D DTensor of ``numel`` elements (element-wise optimizers
    such as AdamW step the same; shape-aware ones see a vector; initialise after meta-device
    init inside ``unsharded(model, writeback=True)``); the state dict shows the
    parameter in its own shape, sharded on dim 0, interchangeable with the default layout
    (state dict calls gather it: collectives; ``broadcast_from_rank0`` loading is not supported
    yet). docs/planning.md says when it pays and what it changes."""


def flat_where_padded(world_size: int) -> Callable[[nn.Parameter], Optional[FlatShard]]:
    """A ``shard_placement_fn``: `FlatShard` for each parameter of 2+ dims whose rows do not divide
    over ``world_size`` shard ranks (where dim 0 pads), the default layout for the rest."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"flat_where_padded(world_size) takes the shard ranks (an int >= 1), got {world_size!r}."
        )

    def choose(param: nn.Parameter) -> Optional[FlatShard]:
        return FlatShard() if param.dim() > 1 and param.shape[0] % world_size else None

    return choose


@dataclass(frozen=True)
class ShardPlacement:
    """What ``shard_placement_fn`` may return to put a parameter on a mesh of its own (e.g. MoE
    experts on an expert-parallel mesh): ``placement`` (``Shard(d)``, `FlatShard`; ``None``: dim 0) and the
    ``mesh`` (1-D, or 2-D for HSDP). A call's parameters on one mesh communicate together.
    PyTorch's ``ShardPlacementResult`` is read too."""

    placement: Optional[Union[Shard, FlatShard]]
    mesh: Any


def shard_choice_for(
    param: nn.Parameter, fqn: str, shard_placement_fn: Optional[Callable[[nn.Parameter], Any]]
) -> tuple[int, Any]:
    """The dim ``shard_placement_fn`` chose for ``param`` (default 0), checked, and its mesh (``None``:
    the call's)."""
    if shard_placement_fn is None:
        return 0, None
    choice = shard_placement_fn(param)
    mesh = None
    if isinstance(choice, ShardPlacement):
        choice, mesh = choice.placement, choice.mesh
    elif type(choice).__name__ == "ShardPlacementResult" and hasattr(choice, "mesh_info"):  # PyTorch's
        choice, mesh = choice.placement, choice.mesh_info.mesh  # type: ignore[attr-defined]
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"shard_placement_fn chose {mesh!r} as the mesh of parameter '{fqn}'; it must be a DeviceMesh "
            "(1-D, or 2-D (replicate, shard) for HSDP). Fix: return ShardPlacement(Shard(0), mesh=...)."
        )
    if choice is None:
        return 0, mesh
    if isinstance(choice, FlatShard):
        if isinstance(param, DTensor):
            raise ValueError(
                f"shard_placement_fn returned FlatShard() for parameter '{fqn}', a tensor-parallel DTensor "
                f"(placements {tuple(param.placements)}); a flat range cannot be laid over its TP shards. "
                "Fix: return None or Shard(dim) for tensor-parallel parameters."
            )
        return FLAT, mesh
    if type(choice) is not Shard:
        raise ValueError(
            f"shard_placement_fn returned {choice!r} for parameter '{fqn}'; it must return Shard(dim), None "
            "(None shards on dim 0), FlatShard(), or ShardPlacement(one of those, mesh=...) for a mesh of "
            "its own."
        )
    ndim = param.dim()
    dim = choice.dim + ndim if choice.dim < 0 else choice.dim
    if not 0 <= dim < ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({choice.dim}) for parameter '{fqn}' of shape "
            f"{tuple(param.shape)}; the dim must be in [-{ndim}, {ndim - 1}]."
        )
    return dim, mesh
