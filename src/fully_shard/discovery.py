"""Which parameters one ``fully_shard`` call manages, and the checks on them.

Everything here only reads the model, so a call that fails a check leaves it untouched.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .mesh import MeshInfo
from .param import ParamPlace


# Original parameters some fully_shard call has replaced by shards -> (its module, its FQN there).
# Why a registry: after fully_shard(embed), a module tied to embed.weight (lm_head) still holds the
# original tensor, and nothing reachable from lm_head says it was sharded. Sharding it again would
# silently untie the weights. Keys are weak and compared by identity, so this holds no per-rank
# state (ranks running as threads never share a tensor) and forgets a tensor when it dies.
_SHARDED_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def claim_originals(found: list[tuple[nn.Parameter, list["ParamPlace"]]]) -> None:
    for param, places in found:
        _SHARDED_ORIGINALS[param] = (weakref.ref(places[0].module), places[0].name)


def is_sharded_module(module: nn.Module) -> bool:
    return "_fsdp_state" in module.__dict__


def _walk(module: nn.Module, fqn: str, seen: set[int], inner: list[tuple[nn.Module, str]]) -> Iterator[tuple[nn.Module, str]]:
    """Modules this call manages: pre-order, stopping at modules an earlier call already sharded."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield module, fqn
    for name, child in module._modules.items():
        if child is None:
            continue
        child_fqn = f"{fqn}.{name}" if fqn else name
        if is_sharded_module(child):
            inner.append((child, child_fqn))
            continue
        yield from _walk(child, child_fqn, seen, inner)


def _inner_owners(inner: list[tuple[nn.Module, str]]) -> dict[int, tuple[str, str]]:
    """id(sharded parameter) -> (owning module's FQN, the parameter's FQN there), for inner calls."""
    owners: dict[int, tuple[str, str]] = {}
    for module, module_fqn in inner:
        group = module.__dict__["_fsdp_state"].group
        for p in group.params if group is not None else ():
            owners[id(p.sharded_param)] = (_label(module, module_fqn), f"{module_fqn}.{p.fqn}")
    return owners


def _original_owner(param: nn.Parameter, walked: list[tuple[nn.Module, str]], inner: list[tuple[nn.Module, str]]) -> Optional[tuple[str, str]]:
    """If an earlier call sharded ``param`` (it is a tied original): (its module's label, the FQN there)."""
    claim = _SHARDED_ORIGINALS.get(param)
    if claim is None:
        return None
    module_ref, name = claim
    module = module_ref()
    for candidate, fqn in [*inner, *walked]:
        if candidate is module:
            return _label(module, fqn), f"{fqn}.{name}" if fqn else name
    return _label(module, ""), name


def _label(module: Optional[nn.Module], fqn: str, article: str = "a") -> str:
    if fqn:
        return f"module '{fqn}'"
    if module is None:
        return "another module"
    cls = type(module).__bases__[-1] if is_sharded_module(module) else type(module)
    return f"{article} {cls.__name__}"


def find_params(
    modules: list[nn.Module], module_names: list[str], ignored: set[int]
) -> list[tuple[nn.Parameter, list[ParamPlace]]]:
    """The parameters this call manages, each with every place it is registered (ties are one entry)."""
    found: dict[int, tuple[nn.Parameter, list[ParamPlace]]] = {}
    seen: set[int] = set()
    inner: list[tuple[nn.Module, str]] = []
    walked = [(m, fqn) for top, name in zip(modules, module_names) for m, fqn in _walk(top, name, seen, inner)]
    owners = _inner_owners(inner)
    for module, module_fqn in walked:
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            where = _label(module, module_fqn, article="this")
            if isinstance(param, DTensor):
                _refuse_claimed(fqn, where, owners.get(id(param)))
            tied_owner = _original_owner(param, walked, inner)
            if tied_owner is not None:
                _refuse_claimed(fqn, where, tied_owner)
            entry = found.setdefault(id(param), (param, []))
            entry[1].append(ParamPlace(module, name, fqn))
    return list(found.values())


def _refuse_claimed(fqn: str, where: str, owner: tuple[str, str] | None) -> None:
    """Raise for a parameter another fully_shard call already manages (or a foreign DTensor)."""
    if owner is not None:
        owner_module, owner_fqn = owner
        raise ValueError(
            f"parameter '{fqn}' (in {where}) is the same tensor as '{owner_fqn}', which an earlier "
            f"fully_shard call manages in {owner_module}. A parameter tied across two fully_shard calls "
            "would be sharded twice and silently untied. Fix: put both modules in one call, e.g. "
            "fully_shard([embedding, output_projection]), or leave both to the enclosing (root) call."
        )
    raise ValueError(
        f"parameter '{fqn}' (in {where}) is already a DTensor: another fully_shard call manages it (a "
        "parameter tied to one sharded earlier, or fully_shard applied to a parent before its children), "
        "or it was distributed by tensor parallelism, which this version does not compose with. Fix: apply "
        "fully_shard bottom-up (inner blocks first, the root last) and keep tied parameters inside one call."
    )


def check_params(found: list[tuple[nn.Parameter, list[ParamPlace]]], info: MeshInfo) -> None:
    """Refuse parameters this version cannot shard correctly, naming each and the fix."""
    for param, places in found:
        fqn = places[0].fqn
        if param.dim() == 0:
            raise ValueError(
                f"parameter '{fqn}' is a 0-dim scalar; fully_shard shards on dim 0. Fix: store it with "
                "shape (1,) (e.g. nn.Parameter(value.reshape(1))), or pass it in ignored_params and keep it "
                "in sync yourself."
            )
        if not param.is_meta and not _device_usable(param.device, info.device):
            raise ValueError(
                f"parameter '{fqn}' is on {param.device}, but the mesh computes on {info.device}. "
                f"Fix: move the module to {info.device} (or to CPU) before fully_shard, or pass a mesh "
                f"on {param.device.type}."
            )
        if not param.is_floating_point() and param.requires_grad:
            raise ValueError(f"parameter '{fqn}' has dtype {param.dtype} and requires grad; that cannot be trained.")


def _device_usable(device: torch.device, mesh_device: torch.device) -> bool:
    if mesh_device.type == "cpu":
        return device.type == "cpu"
    return device.type == "cpu" or device == mesh_device


def move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    for top in modules:
        for module in top.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def shard_dim_for(
    param: nn.Parameter, fqn: str, shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]]
) -> int:
    """The dim ``shard_placement_fn`` chose for ``param`` (0 without one), checked."""
    if shard_placement_fn is None:
        return 0
    placement = shard_placement_fn(param)
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for parameter '{fqn}'; it must return Shard(dim) "
            "or None (None shards on dim 0)."
        )
    ndim = param.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({placement.dim}) for parameter '{fqn}' of shape "
            f"{tuple(param.shape)}; the dim must be in [-{ndim}, {ndim - 1}]."
        )
    return dim
